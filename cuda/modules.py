"""Compiling this package's .cu sources into CuPy RawModules: lazily, once per process and source.

CuPy picks the target from the device it runs on (`-arch=sm_90` on an H100/H200, as a cubin through
NVRTC); the kernels use mma.sync.m16n8k16, so anything older than sm_80 is refused with a clear error.
A failed build raises RuntimeError naming the source file and the kernel that was asked for.
"""
from __future__ import annotations

import functools
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
COMPILE_OPTIONS = ("--std=c++17",)
MIN_COMPUTE_CAPABILITY = 80


def read_source(filename: str) -> str:
    """The CUDA C source of `filename` in this package (tests may patch this to plant a bug)."""
    return (SOURCE_DIR / filename).read_text(encoding="utf-8")


@functools.cache
def _module(filename: str):
    import cupy

    capability = int(cupy.cuda.Device().compute_capability)
    if capability < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(f"offline_paged.cuda needs compute capability >= 8.0 (tensor-core mma.sync); "
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
