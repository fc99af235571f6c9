"""ops/kernel_launch.py's pieces that need no GPU: the driver structs' layout and the argument packing."""
from __future__ import annotations

import ctypes
import struct

import numpy as np

from offline_paged.ops.kernel_launch import _ATTRIBUTE, _dims, _LaunchAttribute, _LaunchConfig, _packed


def test_launch_structs_have_the_layout_of_cuda_h():
    # cuda.h (CUDA 12-13): CUlaunchAttribute is an int id, 4 bytes of padding and a 64-byte union; CUlaunchConfig
    # six unsigned dims, the shared-memory bytes, then the 8-byte-aligned stream, attrs and numAttrs.
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    offsets = {name: getattr(_LaunchConfig, name).offset for name, _ in _LaunchConfig._fields_}
    assert offsets == {"grid": 0, "block": 12, "shared_mem_bytes": 24, "stream": 32, "attrs": 40, "num_attrs": 48}
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert struct.unpack_from("<ii", bytes(_ATTRIBUTE), 0)[0] == 6  # PROGRAMMATIC_STREAM_SERIALIZATION
    assert struct.unpack_from("<i", bytes(_ATTRIBUTE), 8)[0] == 1  # allowed


class _DeviceArray:  # what _packed reads of a cupy.ndarray
    def __init__(self, pointer: int) -> None:
        self.data = type("MemoryPointer", (), {"ptr": pointer})()


def test_arguments_are_packed_as_cupy_passes_them():
    args = (_DeviceArray(0x7F00_1234_5678), np.int32(-2), np.float32(1.5), np.uint64(0), np.int64(-7),
            np.float64(0.25))
    buffer, pointers = _packed(args)
    assert [p - ctypes.addressof(buffer) for p in pointers] == [0, 8, 16, 24, 32, 40]
    raw = bytes(buffer.raw)
    assert struct.unpack_from("<Q", raw, 0)[0] == 0x7F00_1234_5678
    assert struct.unpack_from("<i", raw, 8)[0] == -2
    assert struct.unpack_from("<f", raw, 16)[0] == 1.5
    assert struct.unpack_from("<Q", raw, 24)[0] == 0
    assert struct.unpack_from("<q", raw, 32)[0] == -7
    assert struct.unpack_from("<d", raw, 40)[0] == 0.25


def test_an_argument_of_another_kind_leaves_the_launch_to_cupy():
    assert _packed((_DeviceArray(16), 3)) is None  # a Python int: CuPy decides its C type
    assert _packed((np.float32(1.0), None)) is None


def test_grid_and_block_dimensions_fill_to_three():
    assert list(_dims(7)) == [7, 1, 1]
    assert list(_dims((4, 2))) == [4, 2, 1]
    assert list(_dims((np.int64(3), 2, 5))) == [3, 2, 5]
