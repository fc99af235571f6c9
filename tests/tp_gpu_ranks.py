"""Test helper for tests/test_tensor_parallel_gpu.py: one tensor-parallel rank of the scaled-down 8B
shape as a spawned process (one process per GPU: the kernel cache holds one device's functions)."""
from __future__ import annotations

import numpy as np

from fixtures_random_weights import random_weights

from offline_paged.models.config import LlamaConfig, RopeScaling

# The Llama-3.1-8B shape scaled down: its head_dim, GQA ratio, intermediate ratio and RoPE scaling.
SMALL_8B = LlamaConfig(
    vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=4096,
    tie_word_embeddings=False, eos_token_ids=(1,))


def plan(vocab_size: int):
    """Prefill chunks (the second on a cached prefix), then three decode steps, for four prompts."""
    prompts = [np.random.default_rng(i).integers(0, vocab_size, n).tolist() for i, n in enumerate([37, 64, 12, 100])]
    steps = [[(i, p[:len(p) // 2]) for i, p in enumerate(prompts)],
             [(i, p[len(p) // 2:-3]) for i, p in enumerate(prompts)]]
    return steps + [[(i, [p[-back]]) for i, p in enumerate(prompts)] for back in (3, 2, 1)]


def logits(model) -> np.ndarray:
    from offline_paged.models.simple_runner import SimpleRunner

    runner = SimpleRunner(model, num_blocks=64, block_size=16, seed=11)
    return np.concatenate([np.concatenate(runner.step(batch, all_logits=True))
                           for batch in plan(model.config.vocab_size if model.tp is None else model.tp.vocab_size)])


def rank_logits(rank: int, world_size: int, unique_id, seed: int) -> np.ndarray:
    """Rank `rank`'s gathered fp16 logits [rows, V] of the plan, on GPU `rank` over NCCL."""
    import cupy

    cupy.cuda.Device(rank).use()
    from offline_paged.ops.ops_cuda import CudaOps
    from offline_paged.models.llama import Llama
    from offline_paged.models.tp_shard import TensorParallelShard, shard_config, shard_weights
    from offline_paged.tp.tp_nccl import NcclCommunicator

    weights = random_weights(SMALL_8B, seed)
    tp = TensorParallelShard(rank, world_size, SMALL_8B.vocab_size, NcclCommunicator(unique_id, rank, world_size))
    model = Llama(shard_config(SMALL_8B, world_size), shard_weights(SMALL_8B, weights, rank, world_size),
                  CudaOps(), np.float16, tp=tp)
    return logits(model)
