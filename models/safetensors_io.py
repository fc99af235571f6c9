"""Reading safetensors files with our own header parser (no pickle, ever).

Doing the parsing ourselves lets every failure name the file and the problem (truncated data,
corrupt header, unsupported dtype) and lets bfloat16 be widened to float32 without torch.
Writing goes through the `safetensors` package.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_MAX_HEADER = 100 * 1024 * 1024


def read_safetensors(path: str | Path, names: set[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of one safetensors file (only `names` if given) as numpy arrays; BF16 becomes float32.

    Raises ValueError naming the file for a corrupt or truncated file or an unsupported dtype."""
    path = Path(path)
    header, data_start = _read_header(path)
    file_size = path.stat().st_size
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        out[name] = _read_tensor(path, name, info, data_start, file_size)
    return out


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
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + header_len


def _read_tensor(path: Path, name: str, info: dict, data_start: int, file_size: int) -> np.ndarray:
    dtype_name = info.get("dtype")
    if dtype_name not in _DTYPES:
        raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype_name} "
                         f"(supported: {', '.join(_DTYPES)})")
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    dtype = np.dtype(_DTYPES[dtype_name])
    if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"{path}: tensor {name} byte range does not match shape {shape} and dtype {dtype_name}")
    if data_start + end > file_size:
        raise ValueError(f"{path}: truncated safetensors file (tensor {name} needs bytes up to "
                         f"{data_start + end}, file has {file_size})")
    array = np.fromfile(path, dtype=dtype, count=(end - begin) // dtype.itemsize,
                        offset=data_start + begin).reshape(shape)
    if dtype_name == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array
