"""Tensor-parallel sharding arithmetic on the CPU: N thread ranks over a NumPy fake communicator run
the sharded model through a paged cache (chunked prefill, then decode steps) and must give the
unsharded model's logits; splits that do not divide are refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.config import LlamaConfig
from offline_paged.models.llama import Llama
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.models.tp_shard import TensorParallelShard, shard_config, shard_weights
from offline_paged.models.weight_spec import expected_weight_shapes
from offline_paged.ops.ops_numpy import NumpyOps
from offline_paged.tp.tp_communicator import run_ranks

BLOCK_SIZE = 4
NUM_BLOCKS = 48


def random_model(architecture: str = "LlamaForCausalLM", vocab_size: int = 97, tied: bool = False,
                 seed: int = 0, **overrides) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Random weights scaled so activations are O(1) and logits far from uniform."""
    config = LlamaConfig(**(dict(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, rope_theta=500.0,
        max_position_embeddings=256, tie_word_embeddings=tied, architecture=architecture,
        eos_token_ids=(vocab_size - 1,)) | overrides))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):
            weights[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        elif "embed_tokens" in name:
            weights[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * 1.5 / shape[-1] ** 0.5).astype(np.float32)
    return config, weights


def paged_script(model, vocab_size: int, seed: int = 3) -> list[np.ndarray]:
    """Logits of a fixed workload: three prompts prefilled in chunks of 5 (mixed batches), then four
    decode steps fed fixed random tokens. The block order is shuffled from a fixed seed, so every rank
    uses the same block ids."""
    rng = np.random.default_rng(seed)
    runner = SimpleRunner(model, NUM_BLOCKS, BLOCK_SIZE, seed=1)
    prompts = [rng.integers(0, vocab_size, size=n).tolist() for n in (11, 6, 17)]
    out = list(runner.prefill(list(enumerate(prompts)), chunk=5))
    for _ in range(4):
        tokens = rng.integers(0, vocab_size, size=len(prompts)).tolist()
        out += runner.step([(s, [t]) for s, t in enumerate(tokens)])
    return out


def sharded_logits(config, weights, world_size: int, dtype) -> list[list[np.ndarray]]:
    def rank_fn(rank, comm):
        tp = TensorParallelShard(rank, world_size, config.vocab_size, comm)
        model = Llama(shard_config(config, world_size), shard_weights(config, weights, rank, world_size),
                      NumpyOps(), dtype, tp=tp)
        assert model.allocate_kv_cache(1, BLOCK_SIZE).shape[4] == config.num_key_value_heads // world_size
        return paged_script(model, config.vocab_size)

    return run_ranks(rank_fn, world_size)


@pytest.mark.parametrize("architecture, vocab_size, tied, world_size", [
    ("LlamaForCausalLM", 97, False, 2),  # vocabulary not divisible by 2: padded slice on rank 1
    ("LlamaForCausalLM", 96, True, 2),  # tied embeddings: the LM head is the sharded embedding
    ("Qwen2ForCausalLM", 97, False, 2),  # q/k/v biases split with their columns
    ("Qwen3ForCausalLM", 96, True, 4),  # replicated per-head q/k norms; one KV head per rank
])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 0.0), (np.float32, 1e-4)])
def test_sharded_forward_equals_unsharded(architecture, vocab_size, tied, world_size, dtype, rtol):
    """float64: only the float32 rounding of the logits (|logit| < 16) differs, so 1e-5 absolute;
    float32: split sums round differently (fp32 tolerance 1e-4 relative on top)."""
    config, weights = random_model(architecture, vocab_size, tied)
    reference = paged_script(Llama(config, weights, NumpyOps(), dtype), vocab_size)
    per_rank = sharded_logits(config, weights, world_size, dtype)
    assert len(reference) == 3 + 4 * 3
    for rank, logits in enumerate(per_rank):
        for got, want in zip(logits, reference, strict=True):
            assert got.shape == (vocab_size,) and got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5 if rtol == 0 else 1e-4, err_msg=f"rank {rank}")
    for other in per_rank[1:]:  # NCCL gives every rank the same sums; so must the fake
        for a, b in zip(per_rank[0], other):
            np.testing.assert_array_equal(a, b)
    assert np.ptp(reference[-1]) > 1.0  # logits far from uniform: a wrong shard could not hide


def test_consume_weights_empties_the_shard_dict_and_changes_nothing():
    config, weights = random_model()
    shard = shard_weights(config, weights, 0, 2)
    keep = Llama(shard_config(config, 2), dict(shard), NumpyOps())
    consumed = Llama(shard_config(config, 2), shard, NumpyOps(), consume_weights=True)
    assert shard == {}
    np.testing.assert_array_equal(consumed.layers[1].gate_up, keep.layers[1].gate_up)
    assert len(weights) == len(expected_weight_shapes(config))  # the source itself is untouched
