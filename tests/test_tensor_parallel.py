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


def test_shard_slices_are_the_megatron_split():
    config, weights = random_model("Qwen2ForCausalLM", 97)
    shard = shard_weights(config, weights, 1, 2)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(shard["model.layers.0.self_attn.q_proj.weight"], q[32:64])
    np.testing.assert_array_equal(shard["model.layers.0.self_attn.k_proj.bias"],
                                  weights["model.layers.0.self_attn.k_proj.bias"][16:32])
    np.testing.assert_array_equal(shard["model.layers.0.mlp.down_proj.weight"],
                                  weights["model.layers.0.mlp.down_proj.weight"][:, 32:64])
    embed = shard["model.embed_tokens.weight"]
    assert embed.shape == (49, 48)
    np.testing.assert_array_equal(embed[:48], weights["model.embed_tokens.weight"][49:])
    assert not embed[48].any()  # the padding row
    assert shard_config(config, 2).num_key_value_heads == 2


def test_shard_reads_only_its_slices():
    """shard_weights slices the views it is given; it never converts a whole tensor."""
    config, weights = random_model()
    touched: list[tuple[str, object]] = []

    class View:
        def __init__(self, name, array):
            self.name, self.array, self.shape = name, array, array.shape

        def __getitem__(self, index):
            touched.append((self.name, index))
            return self.array[index]

    shard_weights(config, {n: View(n, w) for n, w in weights.items()}, 0, 2)
    sliced = {n for n, _ in touched}
    assert "model.layers.0.self_attn.o_proj.weight" in sliced and "model.embed_tokens.weight" in sliced
    assert all(index != slice(None) for _, index in touched)


@pytest.mark.parametrize("overrides, field", [
    (dict(num_attention_heads=6, num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_attention_heads=9, num_key_value_heads=9, head_dim=8), "num_attention_heads"),
    (dict(intermediate_size=63), "intermediate_size"),
])
def test_refuses_splits_that_do_not_divide(overrides, field):
    config, weights = random_model(**overrides)
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2 does not divide {field}"):
        shard_config(config, 2)
    with pytest.raises(ValueError, match=f"does not divide {field}"):
        shard_weights(config, weights, 0, 2)


def test_refuses_bad_rank_and_size():
    config, weights = random_model()
    with pytest.raises(ValueError, match="rank must be an integer in 0..1"):
        shard_weights(config, weights, 2, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        shard_config(config, 0)


def test_consume_weights_empties_the_shard_dict_and_changes_nothing():
    config, weights = random_model()
    shard = shard_weights(config, weights, 0, 2)
    keep = Llama(shard_config(config, 2), dict(shard), NumpyOps())
    consumed = Llama(shard_config(config, 2), shard, NumpyOps(), consume_weights=True)
    assert shard == {}
    np.testing.assert_array_equal(consumed.layers[1].gate_up, keep.layers[1].gate_up)
    assert len(weights) == len(expected_weight_shapes(config))  # the source itself is untouched


@pytest.mark.parametrize("bf16", [False, True])
def test_checkpoint_source_reads_memory_mapped_slices_equal_to_the_loaded_model(tmp_path, bf16):
    """CheckpointSource slices memory-mapped views (BF16 widened after slicing); every rank's shard equals
    the slice of the fully loaded checkpoint."""
    import torch

    from offline_paged.models.loader import load_model
    from offline_paged.models.tp_source import CheckpointSource
    from offline_paged.models.tp_views import TensorView, checkpoint_views
    from tiny_llama import make_tiny_hf_model, write_tiny_tokenizer

    make_tiny_hf_model(tmp_path, family="qwen2", dtype=torch.bfloat16 if bf16 else None)
    write_tiny_tokenizer(tmp_path, 97)
    loaded = load_model(tmp_path)
    source = CheckpointSource(str(tmp_path))
    assert isinstance(checkpoint_views(tmp_path, loaded.config)["lm_head.weight"], TensorView)
    for rank in range(2):
        local, shard = source.shard(rank, 2)
        assert local == shard_config(loaded.config, 2)
        want = shard_weights(loaded.config, loaded.weights, rank, 2)
        assert shard.keys() == want.keys()
        for name in want:
            assert shard[name].dtype == np.float32
            np.testing.assert_array_equal(shard[name], want[name], err_msg=name)
