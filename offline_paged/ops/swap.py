"""BlockSwapper: moves KV blocks between the device pool and a CPU pool in pinned host memory.

Both pools have the model's layout [L, 2, N, B, Hkv, D]; a swap of n blocks is one gather on axis 2
on the source side, one bulk copy over PCIe through a pinned staging buffer, and one scatter on axis 2
on the destination side (all layers, K and V at once).
"""
from __future__ import annotations

import math

import cupy
import numpy as np


def pinned_empty(shape, dtype) -> np.ndarray:
    """A numpy array backed by page-locked host memory (fast, asynchronous-capable DMA)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    memory = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
    return np.frombuffer(memory, dtype=dtype, count=math.prod(shape)).reshape(shape)


class BlockSwapper:
    """Owns the pinned CPU pool and one pinned staging buffer that grows to the largest swap seen."""

    def __init__(self, gpu_cache, num_cpu_blocks: int):
        if not isinstance(gpu_cache, cupy.ndarray) or gpu_cache.ndim != 6:
            raise ValueError("gpu_cache must be a cupy array [L, 2, N, B, Hkv, D]")
        self.gpu_cache = gpu_cache
        shape = list(gpu_cache.shape)
        shape[2] = num_cpu_blocks
        self.cpu_cache = pinned_empty(tuple(shape), gpu_cache.dtype)  # [L, 2, Ncpu, B, Hkv, D]
        self._staging = pinned_empty((0,), gpu_cache.dtype)

    def _stage(self, num_blocks: int) -> np.ndarray:
        shape = list(self.gpu_cache.shape)
        shape[2] = num_blocks
        size = math.prod(shape)
        if self._staging.size < size:
            self._staging = pinned_empty((size,), self.gpu_cache.dtype)
        return self._staging[:size].reshape(shape)  # [L, 2, n, B, Hkv, D]

    def swap_out(self, gpu_ids, cpu_ids) -> None:
        """cpu_cache[:, :, cpu_ids] <- gpu_cache[:, :, gpu_ids]; returns once the data is on the host."""
        gpu_ids, cpu_ids = _ids(gpu_ids, cpu_ids)
        if not gpu_ids.size:
            return
        gathered = self.gpu_cache[:, :, cupy.asarray(gpu_ids)]  # [L, 2, n, B, Hkv, D] on the device
        staging = self._stage(gpu_ids.size)
        gathered.get(out=staging)
        self.cpu_cache[:, :, cpu_ids] = staging

    def swap_in(self, cpu_ids, gpu_ids) -> None:
        """gpu_cache[:, :, gpu_ids] <- cpu_cache[:, :, cpu_ids] (enqueued on the current stream)."""
        cpu_ids, gpu_ids = _ids(cpu_ids, gpu_ids)
        if not gpu_ids.size:
            return
        staging = self._stage(cpu_ids.size)
        np.take(self.cpu_cache, cpu_ids, axis=2, out=staging)
        self.gpu_cache[:, :, cupy.asarray(gpu_ids)] = cupy.asarray(staging)


def _ids(a, b) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(a, dtype=np.int64).reshape(-1)
    b = np.asarray(b, dtype=np.int64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"swap needs as many source as destination ids ({a.size} vs {b.size})")
    return a, b
