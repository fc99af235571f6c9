"""A non-editable install works: models/, cli/ and cuda/ (as kernels/) land inside the offline_paged
namespace.

The editable install the test suite runs under maps the source tree directly, so it would hide
packaging mistakes (a missing package-dir entry, .cu files left out of package data, a stray
top-level `models`). Here pip builds and installs a copy of the repository into an empty target
directory, offline (--no-index, --no-build-isolation), and a fresh interpreter started with -S (no
site-packages .pth files, so the editable finder is not loaded) imports from that directory only,
plus the venv's site-packages for third-party dependencies.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _copy_sources(dest: Path) -> None:
    """Copy what the build reads (pyproject, readme, licence, package dirs), not .venv or build/."""
    dest.mkdir()
    for name in ("pyproject.toml", PYPROJECT["project"].get("readme", "README.md")):
        shutil.copy2(REPO_ROOT / name, dest / name)
    for licence in REPO_ROOT.glob("LICEN[CS]E*"):
        shutil.copy2(licence, dest / licence.name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for source_dir in set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO_ROOT / source_dir, dest / source_dir, ignore=skip)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """pip-install a copy of the repo (not editable, offline) into an empty target directory."""
    root = tmp_path_factory.mktemp("packaging")
    source, target = root / "src", root / "target"
    _copy_sources(source)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        capture_output=True, text=True, cwd=root,
    )
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    return target


def _run_isolated(target: Path, code: str) -> subprocess.CompletedProcess:
    """Run `code` in `python -S` with sys.path = [target, the venv's site-packages]."""
    site_packages = sysconfig.get_paths()["purelib"]
    prelude = f"import sys; sys.path[:] = [{str(target)!r}, {site_packages!r}] + sys.path[1:]\n"
    return subprocess.run(
        [sys.executable, "-S", "-c", prelude + code],
        capture_output=True, text=True, cwd=target.parent,
    )


def test_only_the_offline_paged_namespace_is_installed(installed: Path) -> None:
    top_level = {path.name for path in installed.iterdir()}
    assert "offline_paged" in top_level
    for stray in ("models", "cli", "cuda"):
        assert stray not in top_level, f"a top-level `{stray}` package was installed"
    unexpected = {
        name for name in top_level
        if name not in {"offline_paged", "bin"} and not name.endswith(".dist-info")
    }
    assert not unexpected, f"unexpected top-level entries in the install: {sorted(unexpected)}"


def test_subpackages_import_from_the_installed_copy(installed: Path) -> None:
    result = _run_isolated(installed, (
        "import offline_paged, offline_paged.ops.attention as attention, offline_paged.cli.main as main\n"
        "print(offline_paged.__file__); print(attention.__file__); print(main.__file__)\n"
        "import importlib.util\n"
        "print(importlib.util.find_spec('models'), importlib.util.find_spec('cli'))\n"
    ))
    assert result.returncode == 0, result.stderr
    *files, stray_specs = result.stdout.splitlines()
    for file in files:
        assert Path(file).is_relative_to(installed), f"imported {file} from outside the install"
    assert stray_specs == "None None", f"top-level models/cli importable: {stray_specs}"


def test_console_entry_point_runs_from_the_installed_copy(installed: Path) -> None:
    result = _run_isolated(installed, (
        "from offline_paged.cli.main import cli\n"
        "cli(['--version'])\n"
    ))
    assert result.returncode == 0, result.stderr
    assert PYPROJECT["project"]["version"] in result.stdout
    assert (installed / "bin" / "offline-paged").exists(), "console script `offline-paged` missing"


def test_cuda_sources_ship_as_package_data(installed: Path) -> None:
    cuda_dir = PYPROJECT["tool"]["setuptools"]["package-dir"]["offline_paged.kernels"]
    sources = sorted(p.name for p in (REPO_ROOT / cuda_dir).glob("*.cu"))
    assert {"attention.cu", "cache.cu", "layer.cu", "sampling.cu"} <= set(sources), \
        f"the repository's {cuda_dir}/ lacks kernel sources: {sources}"
    installed_sources = sorted(p.name for p in (installed / "offline_paged" / "kernels").glob("*.cu"))
    assert installed_sources == sources


def test_the_kernel_loader_reads_the_installed_sources(installed: Path) -> None:
    result = _run_isolated(installed, (
        "from offline_paged.ops import kernel_modules\n"
        "print(len(kernel_modules.read_source('attention.cu')))\n"
        "print(kernel_modules.source_path('attention.cu'))\n"
        "print(kernel_modules.source_path('common.cuh'))\n"
    ))
    assert result.returncode == 0, result.stderr
    size, where, header_where = result.stdout.splitlines()
    source = (REPO_ROOT / "cuda" / "attention.cu").read_text(encoding="utf-8")
    for header in ("fp8.cuh", "common.cuh"):  # the local headers inlined
        text = (REPO_ROOT / "cuda" / header).read_text(encoding="utf-8")
        source = source.replace(f'#include "{header}"\n', text + "\n")
    assert int(size) == len(source)
    for path in (where, header_where):
        assert Path(path).is_relative_to(installed), f"kernel sources read from {path}, not the install"


def test_license_is_an_spdx_string_and_the_plot_extra_brings_matplotlib() -> None:
    """setuptools deprecates the `project.license` table (removal announced for 2027-02); `bench --plot`
    needs matplotlib, which only the `plot` extra installs."""
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert any(r.startswith("matplotlib") for r in PYPROJECT["project"]["optional-dependencies"]["plot"])
    assert any(r.startswith("huggingface_hub") for r in PYPROJECT["project"]["dependencies"])
