"""PinnedUpload and PinnedDownload: host<->device copies that return at once, for the async engine loop.

A copy from pageable host memory cannot start before the stream's earlier work has run, so the host
waits for the step on the device: with async scheduling that is exactly the wait the loop must not
have. Copies from and to page-locked (pinned) memory are queued and return at once.

PinnedUpload stages a host array into one of `num_slots` pinned buffers, used in turn, then queues the
copy to the device on the current stream. A slot is written again `num_slots` uploads later; the engine
keeps at most one step in flight, so two uploads per step and four slots leave every slot's copy done
(its step finished) before the slot is reused.
"""
from __future__ import annotations

import weakref

import cupy
import numpy as np

from offline_paged.ops.swap import pinned_empty


def pin_in_place(host: np.ndarray) -> np.ndarray:
    """Page-lock the memory of a C-contiguous host array (e.g. shared memory another process writes), so
    copies from it are queued like copies from pinned_empty's. Unlocked when the array is collected, before
    its memory can go (the array holds its buffer): a later mapping at the same address must not find the
    range registered still."""
    if not host.flags.c_contiguous:
        raise ValueError("pin_in_place needs a C-contiguous array")
    if host.nbytes:
        cupy.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
        weakref.finalize(host, cupy.cuda.runtime.hostUnregister, host.ctypes.data).atexit = False
    return host


class PinnedUpload:
    def __init__(self, num_slots: int = 4) -> None:
        self._slots = [pinned_empty((0,), np.uint8) for _ in range(num_slots)]
        self._next = 0

    def __call__(self, host: np.ndarray, out=None):
        """Queue host -> device; returns `out` (a new device array when None). Same shape and dtype."""
        host = np.ascontiguousarray(host)
        index, self._next = self._next, (self._next + 1) % len(self._slots)
        if self._slots[index].size < host.nbytes:
            self._slots[index] = pinned_empty((max(host.nbytes, 2 * self._slots[index].size, 4096),), np.uint8)
        staged = self._slots[index][:host.nbytes].view(host.dtype).reshape(host.shape)
        staged[...] = host
        if out is None:
            out = cupy.empty(host.shape, dtype=host.dtype)
        out.set(staged)
        return out


class PinnedDownload:
    """device -> pinned host copy queued now; `wait()` blocks on an event recorded after it."""

    __slots__ = ("_host", "_event")

    def __init__(self, device_array) -> None:
        device_array = cupy.ascontiguousarray(device_array)
        self._host = pinned_empty(device_array.shape, device_array.dtype)
        if device_array.nbytes:
            device_array.data.copy_to_host_async(self._host.ctypes.data, device_array.nbytes)
        self._event = cupy.cuda.Event(block=False, disable_timing=True)
        self._event.record()

    def wait(self) -> np.ndarray:
        self._event.synchronize()
        return self._host
