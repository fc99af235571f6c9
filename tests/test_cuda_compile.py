"""Every cuda/*.cu source compiles for sm_90 with nvcc (CPU-only: surfaces syntax errors in CI)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
LAUNCHERS = CUDA_DIR / "launchers.py"

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc is not on PATH, so the .cu sources cannot be compile-checked")


def test_there_are_sources():
    assert {p.name for p in SOURCES} >= {"attention.cu", "cache.cu", "layer.cu"}


@needs_nvcc
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_source_compiles_for_sm90(source, tmp_path):
    result = subprocess.run(["nvcc", "-arch=sm_90", "--std=c++17", "-c", str(source), "-o", str(tmp_path / "k.o")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{source.name} does not compile:\n{result.stderr}"


@needs_nvcc
def test_every_kernel_a_launcher_names_is_defined(tmp_path):
    """The names launchers.py asks CuPy for exist as extern "C" entry points in the compiled PTX."""
    text = LAUNCHERS.read_text(encoding="utf-8")
    wanted = set(re.findall(r'kernel\("(\w+\.cu)", "(\w+)"\)', text))
    wanted |= {("attention.cu", f"paged_attention_d{d}_{mode}") for d in (64, 128) for mode in ("keysplit", "rowsplit")}
    entries: dict[str, str] = {}
    for source in {name for name, _ in wanted}:
        ptx = tmp_path / (source + ".ptx")
        subprocess.run(["nvcc", "-arch=sm_90", "--std=c++17", "--ptx", str(CUDA_DIR / source), "-o", str(ptx)],
                       check=True, capture_output=True, timeout=300)
        entries[source] = ptx.read_text(encoding="utf-8")
    missing = [(s, n) for s, n in sorted(wanted) if f".entry {n}(" not in entries[s]]
    assert not missing, f"launchers name kernels that the sources do not define: {missing}"
