"""Memory-mapped, lazily converted views of an HF safetensors checkpoint, for sharded loading.

`checkpoint_views(directory, config)` maps every tensor the config computes to a `TensorView` over the
loader's own lazy views (models/checkpoint.py: headers validated, names, shapes and dtypes checked
against the config, nothing read). Slicing a TensorView reads only the pages under the slice and
converts only those elements (BF16 widened to float32), so `shard_weights(config, views, rank, N)`
reads one rank's slices.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import LlamaConfig


class TensorView:
    """One tensor of a checkpoint, memory-mapped; `view[index]` reads and converts that slice."""

    def __init__(self, lazy: np.ndarray):
        self._data = lazy  # read-only view in the checkpoint dtype (bf16 as ml_dtypes.bfloat16)
        self.shape = tuple(lazy.shape)
        self._bf16 = lazy.dtype.name == "bfloat16"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        raw = np.array(self._data[index])  # reads only the pages under the slice
        return raw.astype(np.float32) if self._bf16 else raw


def checkpoint_views(directory: str | Path, config: LlamaConfig) -> dict[str, TensorView]:
    """name -> TensorView of every tensor `config` computes; ValueError naming the file for a name,
    shape or dtype that does not match (nothing is read before the check)."""
    from .loader import read_weights

    lazy = read_weights(Path(directory), config)
    return {name: TensorView(lazy[name]) for name in lazy}
