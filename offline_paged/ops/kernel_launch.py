"""Kernel: a CuPy RawKernel launched with programmatic stream serialization (programmatic dependent launch, PDL).

On Hopper (compute capability 9.0+) a kernel launched with CUDA's PROGRAMMATIC_STREAM_SERIALIZATION attribute may
begin while the kernel before it on the stream is still running: its CTAs are placed as the earlier kernel's leave
and wait in `griddepcontrol.wait` until it has finished and its writes are visible. Inside a decode step's CUDA graph
(~10 kernels a layer, most of them a few microseconds) that hides the launch latency of each kernel boundary. Every
kernel of cuda/ calls grid_dependency_sync() (cuda/launch.cuh) before it touches global memory, which is what
makes the early start safe; tests/test_cuda_compile.py checks that each `__global__` function does.

CuPy launches through cuLaunchKernel without attributes, so this launches through the driver's cuLaunchKernelEx
(ctypes) with the CUfunction CuPy compiled. Arguments are packed as CuPy would: an ndarray as its device pointer, a
NumPy scalar as its bytes. Anything else (a Python int, say), an older GPU, or PROGRAMMATIC_LAUNCH = False launches
through CuPy as before.
"""
from __future__ import annotations

import ctypes
import functools
import struct

import numpy as np

# Launch our kernels with programmatic stream serialization where the GPU has it (an experiment knob for A/Bs).
PROGRAMMATIC_LAUNCH = True
MIN_COMPUTE_CAPABILITY = 90
_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class Kernel:
    """A RawKernel, called as CuPy calls it (grid, block, args, shared_mem=); see the module docstring."""

    __slots__ = ("raw",)

    def __init__(self, raw) -> None:
        self.raw = raw

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        params = _packed(args) if PROGRAMMATIC_LAUNCH and _supported() else None
        if params is None:
            self.raw(grid, block, args, shared_mem=shared_mem)
            return
        import cupy

        config = _LaunchConfig(_dims(grid), _dims(block), shared_mem, cupy.cuda.get_current_stream().ptr,
                               ctypes.pointer(_ATTRIBUTE), 1)
        status = _driver().cuLaunchKernelEx(ctypes.byref(config), self.raw.kernel.ptr, params[1], None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx of {self.raw.name} (grid {grid}, block {block}) failed: "
                               f"{_error_name(status)}")

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self.raw.max_dynamic_shared_size_bytes = value

    def __getattr__(self, name: str):  # the RawKernel's other attributes (name, num_regs, ...)
        return getattr(self.raw, name)


_ATTRIBUTE = _LaunchAttribute(_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1, b"")


def _dims(d) -> ctypes.Array:
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    return (ctypes.c_uint * 3)(*d, *(1,) * (3 - len(d)))


def _packed(args) -> tuple | None:
    """(the buffer, the void** array of pointers into it) holding each argument in an 8-byte slot, or None where an
    argument is neither a device array (CuPy's ndarray: `.data.ptr`) nor a NumPy scalar (CuPy's own launch then
    converts it)."""
    slots = []
    for a in args:
        pointer = getattr(getattr(a, "data", None), "ptr", None)
        if isinstance(pointer, int):
            slots.append(struct.pack("<Q", pointer))
        elif isinstance(a, np.generic) and a.dtype.itemsize <= 8:
            slots.append(a.tobytes().ljust(8, b"\0"))
        else:
            return None
    buffer = ctypes.create_string_buffer(b"".join(slots), 8 * max(len(slots), 1))
    base = ctypes.addressof(buffer)
    return buffer, (ctypes.c_void_p * max(len(slots), 1))(*range(base, base + 8 * len(slots), 8))


@functools.cache
def _supported() -> bool:
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= MIN_COMPUTE_CAPABILITY and hasattr(_driver(), "cuLaunchKernelEx")


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    if hasattr(lib, "cuLaunchKernelEx"):
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def _error_name(status: int) -> str:
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(status, ctypes.byref(name))
    return f"{name.value.decode() if name.value else 'CUDA error'} ({status})"
