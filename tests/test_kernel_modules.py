"""ops.kernel_modules: the .cu sources are found where the install put them (CPU-only; compiling is
tests/test_cuda_compile.py's and the GPU tests' job)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from offline_paged.ops import kernel_modules

REPO_CUDA = Path(__file__).resolve().parents[1] / "cuda"


@pytest.mark.parametrize("source", sorted(p.name for p in REPO_CUDA.glob("*.cu")))
def test_every_repo_source_is_found_and_read_whole(source):
    path = kernel_modules.source_path(source)
    assert path.parent in kernel_modules.SOURCE_DIRS
    text = (REPO_CUDA / source).read_text(encoding="utf-8")
    for header in sorted(REPO_CUDA.glob("*.cuh")):  # local headers come inlined, for NVRTC
        text = text.replace(f'#include "{header.name}"\n', header.read_text(encoding="utf-8") + "\n")
    assert kernel_modules.read_source(source) == text
    assert '#include "' not in re.sub(r"//[^\n]*", "", text)


def test_the_installed_folder_is_searched_before_the_checkout(tmp_path, monkeypatch):
    installed, checkout = tmp_path / "kernels", tmp_path / "cuda"
    installed.mkdir()
    checkout.mkdir()
    (installed / "k.cu").write_text("// installed")
    (checkout / "k.cu").write_text("// checkout")
    (checkout / "only_here.cu").write_text("// checkout only")
    monkeypatch.setattr(kernel_modules, "SOURCE_DIRS", (installed, checkout))
    assert kernel_modules.read_source("k.cu") == "// installed"
    assert kernel_modules.read_source("only_here.cu") == "// checkout only"


def test_a_missing_source_names_the_places_searched(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_modules, "SOURCE_DIRS", (tmp_path / "a", tmp_path / "b"))
    with pytest.raises(FileNotFoundError, match=r"'nope.cu' is in none of .*a.*b"):
        kernel_modules.read_source("nope.cu")
