"""Memory-mapped, lazily converted views of an HF safetensors checkpoint, for sharded loading.

`checkpoint_views(directory, config)` maps every tensor the config computes to a `TensorView`: the
header is parsed and validated by SafetensorsFile, the names and shapes are checked against the config
(as the loader does), and the data is an `np.memmap` that nothing reads until it is sliced. Slicing a
view reads only the pages under the slice and converts only those elements (BF16 widened to float32,
as SafetensorsFile.read does), so `shard_weights(config, views, rank, N)` reads one rank's slices.
(A stand-in until the loader offers its own lazy views; shard_weights takes either.)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import LlamaConfig
from .safetensors_io import SafetensorsFile
from .weight_spec import check_checkpoint_names, expected_weight_shapes

_RAW = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class TensorView:
    """One tensor of a safetensors file, memory-mapped; `view[index]` reads and converts that slice."""

    def __init__(self, file: SafetensorsFile, name: str):
        entry = file.entries[name]
        if entry.dtype not in _RAW:
            raise ValueError(f"{file.path}: tensor {name} has unsupported dtype {entry.dtype} "
                             f"(supported: {', '.join(_RAW)})")
        self.shape, self._bf16 = entry.shape, entry.dtype == "BF16"
        self._data = np.memmap(file.path, dtype=_RAW[entry.dtype], mode="r",
                               offset=file.data_start + entry.begin, shape=entry.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        raw = np.array(self._data[index])  # reads only the pages under the slice
        return (raw.astype(np.uint32) << 16).view(np.float32) if self._bf16 else raw


def checkpoint_views(directory: str | Path, config: LlamaConfig) -> dict[str, TensorView]:
    """name -> TensorView of every tensor `config` computes; ValueError naming the file for a name or
    shape that does not match (nothing is read before the check)."""
    from .loader import _index_tensors, _safetensors_files  # the loader's own file discovery

    directory = Path(directory)
    files = _index_tensors([SafetensorsFile(path) for path in _safetensors_files(directory)])
    try:
        check_checkpoint_names(config, set(files))
    except ValueError as exc:
        raise ValueError(f"{directory}: {exc}") from None
    views = {}
    for name, shape in expected_weight_shapes(config).items():
        if files[name].entries[name].shape != shape:
            raise ValueError(f"{files[name].path}: tensor {name} has shape {files[name].entries[name].shape}, "
                             f"expected {shape} from config.json")
        views[name] = TensorView(files[name], name)
    return views
