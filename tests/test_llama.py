"""Llama forward vs transformers' LlamaForCausalLM on a tiny random model, through the paged cache."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from safetensors.numpy import load_file

from offline_paged.models.config import LlamaConfig
from offline_paged.models.llama import Llama
from offline_paged.models.simple_runner import SimpleRunner, build_metadata
from offline_paged.ops.ops_numpy import NumpyOps
from tiny_llama import hf_logits, make_tiny_hf_model, random_prompts

PROMPT_LENGTHS = [7, 13, 1, 20, 16]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf_model = make_tiny_hf_model(path, seed=1234)
    config = LlamaConfig.from_file(path / "config.json")
    weights = load_file(path / "model.safetensors")
    return hf_model, config, weights


def _ours(tiny, dtype=np.float32) -> Llama:
    _, config, weights = tiny
    return Llama(config, weights, NumpyOps(), dtype=dtype)


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_prefill_logits_match_transformers(tiny, block_size):
    hf_model, config, _ = tiny
    prompts = random_prompts(7, PROMPT_LENGTHS, config.vocab_size)
    runner = SimpleRunner(_ours(tiny), num_blocks=200, block_size=block_size, seed=block_size)
    ours = runner.step(list(enumerate(prompts)), all_logits=True)
    for prompt, logits in zip(prompts, ours):
        np.testing.assert_allclose(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_decode_logits_match_transformers(tiny, block_size):
    """Prefill all but the last 4 tokens of each prompt, then decode them one per step, batched."""
    hf_model, config, _ = tiny
    prompts = random_prompts(8, [9, 21, 5, 17], config.vocab_size)
    runner = SimpleRunner(_ours(tiny), num_blocks=200, block_size=block_size, seed=3)
    runner.step([(i, p[:-4]) for i, p in enumerate(prompts)])
    refs = [hf_logits(hf_model, p) for p in prompts]
    for back in range(4, 0, -1):
        rows = runner.step([(i, [p[-back]]) for i, p in enumerate(prompts)])
        for row, ref in zip(rows, refs):
            np.testing.assert_allclose(row, ref[-back], atol=1e-4, rtol=0)


def test_block_tables_are_shuffled_and_non_contiguous(tiny):
    """Guards the premise of the tests above: the runner really hands out scattered blocks."""
    runner = SimpleRunner(_ours(tiny), num_blocks=200, block_size=1, seed=1)
    runner.step([(0, list(range(10)))])
    table = runner.seqs[0].block_table
    assert np.any(np.diff(table) != 1)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_prefill_equals_one_shot(tiny, chunk):
    _, config, _ = tiny
    prompts = random_prompts(9, PROMPT_LENGTHS, config.vocab_size)
    model = _ours(tiny)
    one_shot = SimpleRunner(model, 200, 4, seed=0).step(list(enumerate(prompts)), all_logits=True)
    chunked_runner = SimpleRunner(model, 200, 4, seed=5)
    chunked = [[] for _ in prompts]
    for start in range(0, max(PROMPT_LENGTHS), chunk):
        part = [(i, p[start:start + chunk]) for i, p in enumerate(prompts) if p[start:start + chunk]]
        for (i, _), logits in zip(part, chunked_runner.step(part, all_logits=True)):
            chunked[i].append(logits)
    for whole, pieces in zip(one_shot, chunked):
        np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-5, rtol=0)


def test_mixed_batch_equals_separate(tiny):
    """Sequences decoding while others prefill a chunk, in one forward, give the same logits as
    each sequence run alone."""
    _, config, _ = tiny
    a, b, c = random_prompts(10, [12, 15, 9], config.vocab_size)
    model = _ours(tiny)
    mixed = SimpleRunner(model, 200, 4, seed=2)
    mixed.step([(0, a[:11]), (1, b[:5])])
    together = mixed.step([(0, a[11:]), (1, b[5:10]), (2, c[:9])], all_logits=True)
    expected = []
    for seq, done, new in ((a, 11, a[11:]), (b, 5, b[5:10]), (c, 0, c[:9])):
        alone = SimpleRunner(model, 200, 4, seed=9)
        if done:
            alone.step([(0, seq[:done])])
        expected.append(alone.step([(0, new)], all_logits=True)[0])
    for got, want in zip(together, expected):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_float64_matches_transformers_float64(tiny):
    hf_model, config, _ = tiny
    hf64 = hf_model.to(dtype=__import__("torch").float64)
    try:
        prompts = random_prompts(11, [6, 19], config.vocab_size)
        ours = SimpleRunner(_ours(tiny, np.float64), 100, 16).step(list(enumerate(prompts)), all_logits=True)
        for prompt, logits in zip(prompts, ours):
            # Logits are returned as float32 by contract, so the bound is float32 rounding of O(1) values.
            np.testing.assert_allclose(logits, hf_logits(hf64, prompt), atol=1e-6, rtol=0)
    finally:
        hf_model.to(dtype=__import__("torch").float32)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
])
def test_rope_scaling_matches_transformers(tmp_path, rope):
    hf_model = make_tiny_hf_model(tmp_path, seed=5, rope_parameters={"rope_theta": 500.0} | rope)
    config = LlamaConfig.from_file(tmp_path / "config.json")
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == rope["rope_type"]
    model = Llama(config, load_file(tmp_path / "model.safetensors"), NumpyOps())
    prompt = random_prompts(12, [60], config.vocab_size)[0]
    logits = SimpleRunner(model, 100, 16).step([(0, prompt)], all_logits=True)[0]
    np.testing.assert_allclose(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_tied_embeddings_match_transformers(tmp_path):
    hf_model = make_tiny_hf_model(tmp_path, seed=6, tie_word_embeddings=True)
    config = LlamaConfig.from_file(tmp_path / "config.json")
    assert config.tie_word_embeddings
    model = Llama(config, load_file(tmp_path / "model.safetensors"), NumpyOps())
    prompt = random_prompts(13, [11], config.vocab_size)[0]
    logits = SimpleRunner(model, 100, 16).step([(0, prompt)], all_logits=True)[0]
    np.testing.assert_allclose(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_wrong_weight_shape_is_named(tiny):
    _, config, weights = tiny
    bad = dict(weights)
    bad["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \(3, 3\)"):
        Llama(config, bad, NumpyOps())


def test_missing_weight_is_named(tiny):
    _, config, weights = tiny
    bad = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing tensors \['model\.norm\.weight'\]"):
        Llama(config, bad, NumpyOps())


def test_all_rows_and_an_injected_matmul_equal_the_default_path(tiny):
    """The decode CUDA graphs call forward with logits_indices=None and their own GEMM as `matmul`:
    that path must compute exactly what the default one does, through the given matmul only."""
    _, config, _ = tiny
    model = _ours(tiny, dtype=np.float64)
    prompts = random_prompts(9, [6, 11, 3], config.vocab_size)
    block_size, tables, slots, ids, positions = 4, [], [], [], []
    for i, prompt in enumerate(prompts):
        tables.append([10 * i + b for b in range(-(-len(prompt) // block_size))])
        for pos, token in enumerate(prompt):
            ids.append(token), positions.append(pos)
            slots.append(tables[-1][pos // block_size] * block_size + pos % block_size)
    meta = build_metadata(np, tables, [len(p) for p in prompts], [len(p) for p in prompts], slots)
    args = (np.asarray(ids, dtype=np.int32), np.asarray(positions, dtype=np.int32))

    default = model.forward(*args, model.allocate_kv_cache(40, block_size), meta,
                            np.arange(len(ids), dtype=np.int32))  # [T, V]
    calls = []

    def counting_matmul(x, w):
        calls.append(w.shape)
        return x @ w

    def counting_logits(x, w):
        calls.append(("lm_head", w.shape))
        return (x @ w).astype(np.float32)

    injected = model.forward(*args, model.allocate_kv_cache(40, block_size), meta, None, matmul=counting_matmul,
                             logits_matmul=counting_logits)
    np.testing.assert_array_equal(injected, default)
    assert len(calls) == 4 * config.num_hidden_layers + 1  # qkv, o_proj, gate_up, down per layer + LM head
    assert calls[-1][0] == "lm_head"


def test_each_linears_input_and_output_hooks_name_the_right_layers(tiny):
    """The forward tells the backend where each output goes (CudaOps fuses an FP8 layer's quantize and scale
    epilogue into those kernels; NumpyOps ignores it): input_norm feeds qkv, attention o_proj, post_norm gate_up,
    silu_mul down; qkv (no bias or q/k norm here: its output goes only into qkv_rope_write_kv), o_proj, gate_up and
    every down but the last are deferred (their outputs go only into rope_write_kv / rms_norm / silu_mul; the last
    down's rows are picked before the final norm). The final norm feeds nothing."""
    _, config, weights = tiny

    @dataclasses.dataclass(frozen=True)
    class Deferred:
        linear: np.ndarray

    class RecordingOps(NumpyOps):
        def __init__(self):
            super().__init__()
            self.feeds = []

        def rms_norm(self, x, weight, eps, residual=None, feeds=None):
            self.feeds.append(("rms_norm", feeds))
            return super().rms_norm(x, weight, eps, residual)

        def silu_mul(self, gate_up, feeds=None):
            self.feeds.append(("silu_mul", feeds))
            return super().silu_mul(gate_up)

        def attention(self, *args, feeds=None, **kwargs):
            self.feeds.append(("attention", feeds))
            return super().attention(*args, feeds=feeds, **kwargs)

        def deferred(self, linear):
            return Deferred(linear)

    ops = RecordingOps()
    model = Llama(config, weights, ops, dtype=np.float64)
    reference = _ours(tiny, dtype=np.float64)
    products = []

    def matmul(x, w):
        products.append(w)
        return x @ (w.linear if isinstance(w, Deferred) else w)

    prompt = [3, 1, 4, 1, 5, 9]
    meta = build_metadata(np, [[0, 1]], [len(prompt)], [len(prompt)], list(range(len(prompt))))
    args = (np.asarray(prompt, dtype=np.int32), np.arange(len(prompt), dtype=np.int32))
    rows = np.asarray([len(prompt) - 1], dtype=np.int32)
    got = model.forward(*args, model.allocate_kv_cache(4, 4), meta, rows, matmul=matmul)
    np.testing.assert_array_equal(got, reference.forward(*args, reference.allocate_kv_cache(4, 4), meta, rows))

    expected_feeds, expected_products = [], []
    for i, layer in enumerate(model.layers):
        expected_feeds += [("rms_norm", layer.qkv), ("attention", layer.o_proj), ("rms_norm", layer.gate_up),
                           ("silu_mul", layer.down)]
        last = i == len(model.layers) - 1
        expected_products += [Deferred(layer.qkv), Deferred(layer.o_proj), Deferred(layer.gate_up),
                              layer.down if last else Deferred(layer.down)]
    expected_feeds.append(("rms_norm", None))  # the final norm
    assert len(ops.feeds) == len(expected_feeds) and len(products) == len(expected_products)
    for (kind, feeds), (want_kind, want) in zip(ops.feeds, expected_feeds):
        assert kind == want_kind and feeds is want
    for product, want in zip(products, expected_products):
        if isinstance(want, Deferred):
            assert isinstance(product, Deferred) and product.linear is want.linear
        else:
            assert product is want
