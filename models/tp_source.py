"""Where a tensor-parallel rank gets its shard: picklable descriptions every rank loads from itself.

A source has `config` (the full model's), `tokenizer` and `shard(rank, world_size, xp, dtype) ->
(shard config, HF-named weights shaped for it)`. Rank 0 builds it and hands it to the spawned ranks,
so what crosses the process boundary is a description (a path, a preset name), never the model:
- `CheckpointSource(name_or_path)`: each rank opens the checkpoint and slices its tensors
  (models/tp_shard.py `shard_weights` takes any name -> view mapping; with the loader's lazy
  memory-mapped views each rank reads only its slices).
- `DummySource(preset, seed)`: each rank draws its own shard's random weights on its device, so a
  70B shape never exists whole anywhere. The values depend on the split (benchmarks only).
- `ArraySource(loaded_model)`: weights already in memory (tests, small models); they are pickled to
  every rank, then sliced. With `full_dummy_preset` ranks draw the whole preset on the host from one
  seed and slice it, so TP=N and TP=1 compute the same model (for small presets).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .config import LlamaConfig
from .tp_shard import shard_config, shard_weights


@dataclass(frozen=True)
class ArraySource:
    """Host arrays already loaded (a LoadedModel's config, weights and tokenizer)."""

    config: LlamaConfig
    weights: dict[str, Any]
    tokenizer: Any

    @classmethod
    def from_loaded(cls, loaded_model) -> ArraySource:
        return cls(loaded_model.config, loaded_model.weights, loaded_model.tokenizer)

    def shard(self, rank: int, world_size: int, xp=np, dtype=np.float32):
        return shard_config(self.config, world_size), shard_weights(self.config, self.weights, rank, world_size)


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint path or name (as `load_model` takes); config and tokenizer read without weights."""

    name_or_path: str | None

    def __reduce__(self):  # only the path crosses to the other ranks, never the cached tokenizer
        return CheckpointSource, (self.name_or_path,)

    @cached_property
    def _meta(self):
        from .loader import load_tokenizer

        return load_tokenizer(self.name_or_path)

    @property
    def config(self) -> LlamaConfig:
        return self._meta[0]

    @property
    def tokenizer(self):
        return self._meta[1]

    def shard(self, rank: int, world_size: int, xp=np, dtype=np.float32):
        """An HF directory: memory-mapped views, sliced (only this rank's slices are read). A GGUF file
        is dequantized whole first (its blocks do not slice), then sliced."""
        from pathlib import Path

        from .default_model import ensure_default_model
        from .tp_views import checkpoint_views

        config = self.config
        name = self.name_or_path
        path = ensure_default_model() if name is None or str(name) == "default" else Path(name)
        if Path(path).suffix == ".gguf":
            from .loader import load_model

            views = load_model(path).weights
        else:
            views = checkpoint_views(path, config)
        return shard_config(config, world_size), shard_weights(config, views, rank, world_size)


@dataclass(frozen=True)
class DummySource:
    """Random weights of a benchmark preset, drawn per shard on the rank's device."""

    preset: str | LlamaConfig  # a dummy_weights preset name, or a config of one's own
    seed: int = 0
    full_on_host: bool = False  # draw the whole model on the host and slice: TP=N computes TP=1's model

    @property
    def config(self) -> LlamaConfig:
        from .dummy_weights import preset_config

        return self.preset if isinstance(self.preset, LlamaConfig) else preset_config(self.preset)

    @property
    def tokenizer(self):
        from .dummy_weights import DummyTokenizer

        return DummyTokenizer(self.config.eos_token_ids)

    def shard(self, rank: int, world_size: int, xp=np, dtype=np.float32):
        from .dummy_weights import random_weights

        config = self.config
        local = shard_config(config, world_size)
        if self.full_on_host:
            return local, shard_weights(config, random_weights(config, np, np.float32, self.seed), rank,
                                        world_size)
        return local, random_weights(local, xp, dtype, self.seed * 1009 + rank)


def as_source(loaded_model, model: str | None):
    """The shard source for an engine: a source as given, a LoadedModel's arrays, or the checkpoint
    `model` names when nothing is loaded."""
    if loaded_model is None:
        return CheckpointSource(model)
    if hasattr(loaded_model, "shard"):
        return loaded_model
    return ArraySource.from_loaded(loaded_model)
