"""Tensor-parallel sharding arithmetic (Megatron-style): which slice of every tensor rank r of N holds.

Column-parallel (split over output features, no communication): q/k/v by heads — rank r holds query
heads [r H/N, (r+1) H/N) and KV heads [r Hkv/N, (r+1) Hkv/N), so its KV cache holds only those KV heads
— and gate/up by intermediate features. Qwen2's q/k/v biases split with their columns.
Row-parallel (split over input features, one all-reduce of the [T, E] partial sums after each):
o_proj and down. Vocabulary-parallel: the embedding and the LM head by vocabulary rows; a token outside
a rank's rows embeds to zero there and the all-reduce of the embeddings sums the one rank that holds
it; each rank's logits [K, V/N] are all-gathered to [K, V] before sampling.
Replicated: the RMSNorm weights and Qwen3's per-head q/k norms.

Divisibility: N must divide the query heads, the KV heads and the intermediate size, or the split is
refused with a ValueError naming the field (no KV-head replication: every supported preset divides).
The vocabulary need not divide: it is padded to N * ceil(V / N) rows with zero rows, whose logits are
cut off after the gather.

`shard_weights` reads through any mapping of name -> array-like that supports basic slicing (a dict of
arrays, or lazily memory-mapped safetensors views): it slices first and never touches the other ranks'
rows, so a memory-mapped checkpoint is read only where this rank's slices lie. Conversion to the model
dtype happens afterwards, in `Llama`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import LlamaConfig
from .weight_spec import expected_weight_shapes


@dataclass(frozen=True, slots=True)
class TensorParallelShard:
    """What a rank's `Llama` needs to run its shard: its place in the group, the full vocabulary size
    (the rank's config holds only its padded slice of it) and the communicator of the group
    (`all_reduce(x)` in place, `all_gather(x) -> [N, *x.shape]`)."""

    rank: int
    world_size: int
    vocab_size: int
    communicator: Any

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def check_divisible(config: LlamaConfig, world_size: int) -> None:
    """Raise ValueError when an N-way split does not divide the heads, KV heads or intermediate size, or the
    checkpoint is pre-quantized FP8 (not sharded yet; checked here, before any rank starts)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if config.quantization is not None and world_size > 1:
        raise ValueError(f"FP8 checkpoints (quantization_config quant_method {config.quantization.method!r}) are "
                         "not supported with tensor_parallel_size > 1 yet")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} does not divide {name} ({value}) of this "
                f"{config.architecture}: every rank must hold whole heads (KV heads are not replicated); "
                f"choose a tensor_parallel_size that divides {name}")


def shard_config(config: LlamaConfig, world_size: int) -> LlamaConfig:
    """The config of one rank's shard: heads, KV heads, intermediate size and vocabulary divided by N
    (vocabulary rounded up). Token ids are dropped from it: they index the full vocabulary, which the
    engine keeps in the full config."""
    check_divisible(config, world_size)
    return dataclasses.replace(
        config,
        vocab_size=-(-config.vocab_size // world_size),
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        bos_token_id=None,
        eos_token_ids=(),
    )


def shard_weights(config: LlamaConfig, views: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Rank `rank`'s slices of every tensor `config` computes, named as in the checkpoint and shaped
    for `shard_config(config, world_size)`. `views` maps HF names to arrays or lazy views ([out, in] for
    linears); only the slices are read. Raises ValueError for a split that does not divide, a bad
    rank, or a missing tensor."""
    check_divisible(config, world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in 0..{world_size - 1}, got {rank!r}")
    names = list(expected_weight_shapes(config))
    missing = [n for n in names if n not in views]
    if missing:
        raise ValueError(f"tensor-parallel sharding: missing tensors {missing[:5]}")
    return {name: _shard(config, name, views[name], rank, world_size) for name in names}


def _shard(config: LlamaConfig, name: str, view, rank: int, world_size: int):
    """One tensor's slice for `rank` (a view where the source allows, a padded copy for the last rank's
    vocabulary rows when N does not divide V)."""
    leaf = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else name
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(view, config.vocab_size, rank, world_size)
    head_dim = config.head_dim
    per_q = config.num_attention_heads // world_size * head_dim
    per_kv = config.num_key_value_heads // world_size * head_dim
    per_i = config.intermediate_size // world_size
    rows = {"q_proj": per_q, "k_proj": per_kv, "v_proj": per_kv, "gate_proj": per_i, "up_proj": per_i}
    if leaf in rows:  # column-parallel: output features are rows of the [out, in] weight (and the bias)
        n = rows[leaf]
        return view[rank * n:(rank + 1) * n]
    if leaf in ("o_proj", "down_proj"):  # row-parallel: input features are its columns
        n = per_q if leaf == "o_proj" else per_i
        return view[:, rank * n:(rank + 1) * n]
    return view[...]  # RMSNorm weights, Qwen3 q/k norms: replicated (read whole)


def _vocab_rows(view, vocab_size: int, rank: int, world_size: int):
    per_rank = -(-vocab_size // world_size)
    start, stop = rank * per_rank, min((rank + 1) * per_rank, vocab_size)
    rows = view[start:stop] if start < vocab_size else view[0:0]
    if stop - start == per_rank:
        return rows
    padded = np.zeros((per_rank,) + tuple(view.shape[1:]), dtype=rows.dtype)  # [V/N, E]
    padded[:max(stop - start, 0)] = np.asarray(rows)
    return padded
