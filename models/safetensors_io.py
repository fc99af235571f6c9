"""Reading safetensors files with our own header parser (no pickle, ever), memory-mapped.

Doing the parsing ourselves lets every failure name the file, the tensor and the field (truncated
data, corrupt header, unsupported dtype). The whole header is validated before any tensor is read:
every entry is an object with a known `dtype`, a `shape` of non-negative integers and `data_offsets`
[begin, end] with 0 <= begin <= end <= data size, whose length matches shape x dtype (computed in
Python integers, so no size can wrap), and no two tensors overlap. Writing goes through the
`safetensors` package.

`SafetensorsFile.view(name)` is a lazy, read-only numpy view of one tensor in its checkpoint dtype
(BF16 as `ml_dtypes.bfloat16`, F8_E4M3 as `ml_dtypes.float8_e4m3fn`) over its own memory map: nothing is read until it is touched, a slice
reads only its pages, and dropping the view unmaps it (its pages leave the process's RSS).
`read(name, dtype)` is an owned copy, converted one tensor at a time.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

_READABLE = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "F8_E4M3": ml_dtypes.float8_e4m3fn}  # FP8 checkpoints: the loader allows it for their linears only
_ITEM_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100 * 1024 * 1024
# Smaller tensors (norms, biases) are read rather than mapped: a view that lives on in a model
# (zero-copy on the CPU) then holds no file descriptor.
_MAP_MIN_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One validated header entry: byte range [begin, end) relative to the start of the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """A safetensors file whose header has been read and fully validated; tensors are read on demand.

    `entries` maps tensor names to `TensorEntry`. Raises ValueError naming the file, and the tensor
    and field where there is one, for anything malformed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header, self.data_start = _read_header(self.path)
        data_size = self.path.stat().st_size - self.data_start
        self.entries = {name: _entry(self.path, name, info, data_size)
                        for name, info in header.items() if name != "__metadata__"}
        if "__metadata__" in header and not isinstance(header["__metadata__"], dict):
            raise ValueError(f"{self.path}: corrupt safetensors header (__metadata__ is not an object)")
        _check_no_overlap(self.path, self.entries)

    def numpy_dtype(self, name: str) -> np.dtype:
        """The numpy dtype of tensor `name` (BF16: ml_dtypes.bfloat16); ValueError if unsupported."""
        entry = self.entries[name]
        if entry.dtype not in _READABLE:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {entry.dtype} "
                             f"(supported: {', '.join(_READABLE)})")
        return np.dtype(_READABLE[entry.dtype])

    def view(self, name: str) -> np.ndarray:
        """Tensor `name` in its checkpoint dtype, read-only and lazy (memory-mapped when >= 1 MiB)."""
        entry, dtype = self.entries[name], self.numpy_dtype(name)
        offset = self.data_start + entry.begin
        if entry.end - entry.begin < _MAP_MIN_BYTES:
            array = np.fromfile(self.path, dtype=dtype, count=math.prod(entry.shape), offset=offset)
            array = array.reshape(entry.shape)
            array.flags.writeable = False
            return array
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=entry.shape)

    def read(self, name: str, dtype=None) -> np.ndarray:
        """An owned copy of tensor `name`, in `dtype` (default: its checkpoint dtype)."""
        return np.array(self.view(name), dtype=dtype)


def read_safetensors(path: str | Path, names: set[str] | None = None, dtype=None) -> dict[str, np.ndarray]:
    """Tensors of one safetensors file (only `names` if given) as owned numpy arrays in `dtype`
    (default: each tensor's own; BF16 is ml_dtypes.bfloat16).

    Raises ValueError naming the file for a corrupt or truncated file or an unsupported dtype."""
    file = SafetensorsFile(path)
    return {name: file.read(name, dtype) for name in file.entries if names is None or name in names}


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER:
                raise ValueError(f"{path}: not a safetensors file (header length {header_len} is implausible)")
            raw = f.read(header_len)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: safetensors file not found") from None
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated safetensors file (header cut short)")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: corrupt safetensors header ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + header_len


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(path: Path, name: str, info, data_size: int) -> TensorEntry:
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: header entry is not an object (got {type(info).__name__})")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEM_SIZES:
        raise ValueError(f"{where}: unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise ValueError(f"{where}: 'shape' must be a list of non-negative integers (got {str(shape)[:80]})")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(n) for n in offsets)):
        raise ValueError(f"{where}: 'data_offsets' must be [begin, end] integers (got {str(offsets)[:80]})")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise ValueError(f"{where}: 'data_offsets' [{begin}, {end}] is not a range 0 <= begin <= end")
    if end > data_size:
        raise ValueError(f"{path}: truncated safetensors file (tensor {name} needs data bytes up to {end}, "
                         f"the file has {data_size})")
    num_bytes = _ITEM_SIZES[dtype] * math.prod(shape)  # Python integers: cannot wrap
    if end - begin != num_bytes:
        raise ValueError(f"{where}: byte range does not match shape {tuple(shape)} and dtype {dtype} "
                         f"('data_offsets' span {end - begin} bytes, shape needs {num_bytes})")
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_no_overlap(path: Path, entries: dict[str, TensorEntry]) -> None:
    previous_name, previous_end = None, 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin < previous_end and entry.end > entry.begin:
            raise ValueError(f"{path}: tensors {previous_name} and {name} overlap in the file "
                             "('data_offsets' ranges share bytes)")
        if entry.end > entry.begin:
            previous_name, previous_end = name, entry.end
