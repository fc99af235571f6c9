"""The conversion/upload step of a streaming load: checkpoint views -> arrays of `xp` in a target dtype.

`to_device(view, xp, dtype)` converts one (possibly sliced) view; `load_tensors(checkpoint, names, xp,
dtype)` streams a list of tensors one at a time, with a tqdm bar for loads longer than two seconds.
No step holds more than one tensor on the host beyond what the result itself keeps:
- numpy: each tensor is copied once, straight into the target dtype (BF16 widened by a shift of its
  bits, so no float32 copy exists unless float32 is the target);
- another array module (CuPy): the checkpoint bytes are uploaded as they are and converted on the
  device; BF16 -> fp16/fp32 is widened on the device from its uint16 bits. With CuPy, whole tensors go
  through `StagedUpload`: file -> a small ring of pinned buffers -> device, overlapping disk reads
  with DMA, so the host never holds a whole tensor either.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np

from .checkpoint import Checkpoint

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_PROGRESS_DELAY_S = 2.0


def to_device(view: np.ndarray, xp: Any, dtype=None) -> Any:
    """An owned `xp` array holding `view` in `dtype` (default: the view's dtype)."""
    view = np.asarray(view)  # a plain ndarray over the same memory (np.memmap's subclass would stick)
    dtype = view.dtype if dtype is None else np.dtype(dtype)
    if view.dtype == BFLOAT16 and dtype != BFLOAT16:
        bits = view.view(np.uint16)  # [same shape] no copy; numpy widens straight from the view
        if xp is not np:
            bits = xp.asarray(np.ascontiguousarray(bits))
        return widen_bfloat16(bits, xp).astype(dtype, copy=False)
    if xp is np:
        return np.array(view, dtype=dtype)
    if dtype == BFLOAT16:
        return xp.asarray(np.ascontiguousarray(view, dtype=BFLOAT16))  # converted on the host, per tensor
    device = xp.asarray(np.ascontiguousarray(view))
    return device if device.dtype == dtype else device.astype(dtype)


def widen_bfloat16(bits, xp: Any):
    """uint16 bfloat16 bit patterns -> float32, exactly (bf16 is the top half of an fp32)."""
    wide = bits.astype(xp.uint32)
    xp.left_shift(wide, 16, out=wide)
    return wide.view(xp.float32)


def load_tensors(checkpoint: Checkpoint, names: Iterable[str], xp: Any, dtype=None,
                 progress: bool = True) -> dict[str, Any]:
    """Tensors `names` of `checkpoint` as `xp` arrays in `dtype` (default: each one's own), one at a
    time in file order; a view is dropped (unmapped) as soon as its tensor is converted."""
    names = sorted(names, key=lambda n: (str(checkpoint.files[n].path), checkpoint.entry(n).begin))
    staged = StagedUpload(xp) if _is_cupy(xp) else None
    bar = _progress_bar(checkpoint.nbytes(names), progress)
    out = {}
    try:
        for name in names:
            if staged is not None:
                out[name] = staged.tensor(checkpoint, name, dtype)
            else:
                out[name] = to_device(checkpoint[name], xp, dtype)
            bar.update(checkpoint.entry(name).end - checkpoint.entry(name).begin)
        if staged is not None:
            staged.synchronize()
    finally:
        bar.close()
    return out


def _progress_bar(total_bytes: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="loading weights",
                delay=_PROGRESS_DELAY_S, disable=not enabled, leave=False)


def _is_cupy(xp: Any) -> bool:
    return getattr(xp, "__name__", "") == "cupy"


class StagedUpload:
    """file bytes -> a ring of `num_buffers` pinned host buffers of `chunk_bytes` -> device (CuPy).

    A buffer is refilled only after the event recorded behind its last copy has fired, so a read of
    chunk k+1 from the page cache overlaps the DMA of chunk k. Host memory: num_buffers x chunk_bytes.
    `device` is the array module (cupy); tests pass a stand-in with the same few calls."""

    def __init__(self, device: Any, chunk_bytes: int = 64 << 20, num_buffers: int = 4):
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.buffers = [_pinned_bytes(device, chunk_bytes) for _ in range(num_buffers)]
        self.events: list[Any] = [None] * num_buffers
        self.stream = device.cuda.Stream(non_blocking=True)
        self.next_buffer = 0
        self.read_s = 0.0

    def tensor(self, checkpoint: Checkpoint, name: str, dtype=None):
        """Tensor `name` on the device in `dtype` (converted there; default: the checkpoint dtype)."""
        file, entry, source = checkpoint.files[name], checkpoint.entry(name), checkpoint.dtype(name)
        dtype = source if dtype is None else np.dtype(dtype)
        raw = self.device.empty(entry.end - entry.begin, dtype=self.device.uint8)  # [bytes]
        # `raw` may reuse memory that kernels queued on the current stream still read (the previous
        # tensor's conversion); the copy stream does not order itself after them by itself.
        self.stream.wait_event(self.device.cuda.get_current_stream().record())
        with open(file.path, "rb", buffering=0) as f:
            self._copy(f.fileno(), file.data_start + entry.begin, raw, file.path)
        if source == BFLOAT16 and dtype != BFLOAT16:
            self.stream.synchronize()  # conversion kernels run on the current stream
            return widen_bfloat16(raw.view(self.device.uint16), self.device).astype(dtype).reshape(entry.shape)
        array = raw.view(source).reshape(entry.shape)
        if array.dtype != dtype:
            self.stream.synchronize()
            array = array.astype(dtype)
        return array

    def synchronize(self) -> None:
        self.stream.synchronize()

    def _copy(self, fd: int, offset: int, raw, path) -> None:
        for start in range(0, raw.nbytes, self.chunk_bytes):
            size = min(self.chunk_bytes, raw.nbytes - start)
            index, self.next_buffer = self.next_buffer, (self.next_buffer + 1) % len(self.buffers)
            if self.events[index] is not None:
                self.events[index].synchronize()
            buffer = self.buffers[index][:size]
            began = time.perf_counter()
            _read_exactly(fd, offset + start, buffer, path)
            self.read_s += time.perf_counter() - began
            self.device.cuda.runtime.memcpyAsync(raw.data.ptr + start, buffer.ctypes.data, size,
                                                 1, self.stream.ptr)  # 1: host to device
            event = self.device.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream)
            self.events[index] = event


def _pinned_bytes(device: Any, nbytes: int) -> np.ndarray:
    memory = device.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes)


def _read_exactly(fd: int, offset: int, buffer: np.ndarray, path) -> None:
    view, done = memoryview(buffer), 0
    while done < buffer.nbytes:
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise ValueError(f"{path}: truncated while loading (no data at byte {offset + done})")
        done += count
