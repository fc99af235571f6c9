"""Compiling the .cu sources of offline_paged.kernels into CuPy RawModules: lazily, once per process and source.

CuPy picks the target from the device it runs on (`-arch=sm_90` on an H100/H200, as a cubin through
NVRTC); the kernels use mma.sync.m16n8k16, so anything older than sm_80 is refused with a clear error.
A failed build raises RuntimeError naming the source file and the kernel that was asked for.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

# The .cu sources are the repo's cuda/, installed as package data offline_paged/kernels/ (pyproject's
# package-dir maps offline_paged.kernels to cuda/). A wheel has that folder beside ops/; an editable
# install of a checkout reads cuda/ beside the offline_paged/ folder.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = (PACKAGE_ROOT / "kernels", PACKAGE_ROOT.parent / "cuda")
COMPILE_OPTIONS = ("--std=c++17",)
MIN_COMPUTE_CAPABILITY = 80


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"$', re.M)


def read_source(filename: str) -> str:
    """The CUDA C source `filename` of offline_paged.kernels with its `#include "x.cuh"` lines replaced by
    those headers (NVRTC gets one text and needs no include path); tests may patch this to plant a bug."""
    return inline_headers(source_path(filename).read_text(encoding="utf-8"))


def replaced(source: str, patches, name: str) -> str:
    """`source` with each (old, new) of `patches` replaced: a source variant of a kernel bench (`name` says which);
    an `old` the source does not contain raises ValueError, so a variant cannot silently stop applying."""
    for old, new in patches:
        if old not in source:
            raise ValueError(f"variant {name}: {old!r} not in the source")
        source = source.replace(old, new)
    return source


def inline_headers(text: str) -> str:
    """CUDA C `text` with its `#include "x.cuh"` lines replaced by those headers of offline_paged.kernels."""
    return _LOCAL_INCLUDE.sub(lambda m: source_path(m.group(1)).read_text(encoding="utf-8"), text)


def source_path(filename: str) -> Path:
    """Where the CUDA C source `filename` is: the installed kernels/ folder, else the checkout's cuda/."""
    for folder in SOURCE_DIRS:
        if (folder / filename).is_file():
            return folder / filename
    raise FileNotFoundError(f"CUDA source {filename!r} is in none of {[str(d) for d in SOURCE_DIRS]}")


@functools.cache
def _module(filename: str):
    import cupy

    capability = int(cupy.cuda.Device().compute_capability)
    if capability < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(f"the CUDA kernels need compute capability >= 8.0 (tensor-core mma.sync); "
                           f"this GPU has {capability / 10:.1f}")
    return cupy.RawModule(code=read_source(filename), options=COMPILE_OPTIONS)


@functools.cache
def kernel(filename: str, name: str):
    """The RawKernel `name` from `filename`, compiling the file on first use."""
    import cupy

    try:
        return _module(filename).get_function(name)
    except cupy.cuda.compiler.CompileException as exc:
        raise RuntimeError(f"CUDA kernel {name!r} ({filename}) failed to compile:\n{exc}") from None


def clear_cache() -> None:
    """Forget compiled modules (after patching `read_source`, say)."""
    _module.cache_clear()
    kernel.cache_clear()
