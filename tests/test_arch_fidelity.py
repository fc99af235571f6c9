"""Qwen2 (q/k/v bias), Qwen3 (per-head q/k norm, explicit head_dim) and Mistral (without and with a
sliding window of 8) through our one decoder vs transformers' own classes on tiny random models: logits
through shuffled block tables, decode, chunked prefill and a mixed batch; greedy continuations through
the engine vs `generate`. The windowed sequences run several windows long."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.engine import LLMEngine
from offline_paged.models.llama import Llama
from offline_paged.models.loader import load_model
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.ops.ops_numpy import NumpyOps
from tiny_engine import run_to_completion
from tiny_llama import hf_logits, make_tiny_hf_model, random_prompts, write_tiny_tokenizer

WINDOW = 8  # Mistral's sliding window here: the prompts below run up to 5 windows long
# name -> (tiny_llama family, overrides of its transformers config)
FAMILIES = {"qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}), "mistral": ("mistral", {}),
            "mistral_window": ("mistral", {"sliding_window": WINDOW})}
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    """(family, transformers model in float32, our LoadedModel read back through the loader)."""
    family, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    hf_model = make_tiny_hf_model(path, seed=77, family=family, **overrides)
    write_tiny_tokenizer(path, hf_model.config.vocab_size)
    return family, hf_model, load_model(path)


def _runner(loaded, block_size: int = 5, seed: int = 0) -> SimpleRunner:
    return SimpleRunner(Llama(loaded.config, loaded.weights, NumpyOps()), 200, block_size, seed=seed)


def test_the_loader_reads_the_architecture(tiny):
    family, hf_model, loaded = tiny
    assert loaded.config.architecture == type(hf_model).__name__
    assert loaded.config.head_dim == hf_model.config.head_dim
    extra = {"qwen2": "model.layers.0.self_attn.k_proj.bias", "qwen3": "model.layers.0.self_attn.k_norm.weight"}
    assert family == "mistral" or extra[family] in loaded.weights
    assert loaded.config.sliding_window == getattr(hf_model.config, "sliding_window", None)


def test_prefill_logits_match_transformers(tiny):
    _, hf_model, loaded = tiny
    prompts = random_prompts(1, [7, 13, 1, 20], loaded.config.vocab_size)
    ours = _runner(loaded).step(list(enumerate(prompts)), all_logits=True)
    for prompt, logits in zip(prompts, ours):
        np.testing.assert_allclose(logits, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_decode_logits_match_transformers(tiny):
    """Prefill all but the last 3 tokens, then decode them one per step, all sequences batched."""
    _, hf_model, loaded = tiny
    prompts = random_prompts(2, [9, 21, 5], loaded.config.vocab_size)
    runner = _runner(loaded, block_size=1, seed=3)
    runner.step([(i, p[:-3]) for i, p in enumerate(prompts)])
    refs = [hf_logits(hf_model, p) for p in prompts]
    for back in range(3, 0, -1):
        rows = runner.step([(i, [p[-back]]) for i, p in enumerate(prompts)])
        for row, ref in zip(rows, refs):
            np.testing.assert_allclose(row, ref[-back], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_transformers(tiny):
    _, hf_model, loaded = tiny
    prompts = random_prompts(3, [11, 16, 4], loaded.config.vocab_size)
    runner, chunk = _runner(loaded, block_size=4, seed=5), 3
    pieces = [[] for _ in prompts]
    for start in range(0, 16, chunk):
        part = [(i, p[start:start + chunk]) for i, p in enumerate(prompts) if p[start:start + chunk]]
        for (i, _), logits in zip(part, runner.step(part, all_logits=True)):
            pieces[i].append(logits)
    for prompt, got in zip(prompts, pieces):
        np.testing.assert_allclose(np.concatenate(got), hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_mixed_batch_matches_transformers(tiny):
    """One forward holding a decode, a later prefill chunk and a first prefill chunk."""
    _, hf_model, loaded = tiny
    a, b, c = random_prompts(4, [12, 15, 9], loaded.config.vocab_size)
    runner = _runner(loaded, block_size=4, seed=2)
    runner.step([(0, a[:11]), (1, b[:5])])
    together = runner.step([(0, a[11:]), (1, b[5:]), (2, c)], all_logits=True)
    for got, prompt, done in zip(together, (a, b, c), (11, 5, 0)):
        np.testing.assert_allclose(got, hf_logits(hf_model, prompt)[done:], atol=ATOL, rtol=0)


def test_engine_greedy_equals_transformers_generate(tiny):
    """Through the engine (chunked prefill mixed with decodes, prefix caching on) in float64, against
    transformers' `generate` in float64."""
    import torch

    _, hf_model, loaded = tiny
    prompts = random_prompts(5, [6, 19, 2], loaded.config.vocab_size)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float64", block_size=4, num_kv_blocks=64,
                                    max_num_seqs=4, max_num_batched_tokens=8), loaded_model=loaded)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    want = _hf_greedy(hf_model, prompts, 10)
    for i in range(len(prompts)):
        assert got[str(i)].outputs[0].token_ids == want[i]


def _hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' `generate`, greedy in float64, no EOS stop; the model is back in float32 after."""
    import torch

    hf64 = hf_model.to(torch.float64)
    eos = hf64.generation_config.eos_token_id
    hf64.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens would mask EOS instead)
    outputs = []
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():  # an explicit mask: generate would mask prompt tokens equal to pad_token_id
                out = hf64.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    finally:
        hf_model.to(torch.float32)
        hf64.generation_config.eos_token_id = eos
    return outputs


@pytest.mark.parametrize("family,tied,overrides", [("qwen2", False, {}), ("qwen3", True, {}),
                                                   ("mistral", False, {"sliding_window": WINDOW})])
def test_bfloat16_checkpoint_matches_transformers(tmp_path, family, tied, overrides):
    """A bf16 save_pretrained (biases and q/k norms in bf16 too) loads, widened, to transformers' logits;
    the Qwen3 one ties its embeddings, as Qwen3-0.6B does; the Mistral prompt is 4 windows long."""
    import torch

    hf_model = make_tiny_hf_model(tmp_path, seed=78, family=family, dtype=torch.bfloat16,
                                  tie_word_embeddings=tied, **overrides)
    assert hf_model.config.tie_word_embeddings == tied
    write_tiny_tokenizer(tmp_path, hf_model.config.vocab_size)
    loaded = load_model(tmp_path)
    assert loaded.config.tie_word_embeddings == tied
    assert loaded.config.sliding_window == overrides.get("sliding_window")
    prompt = random_prompts(6, [4 * WINDOW + 3], loaded.config.vocab_size)[0]
    logits = _runner(loaded).step([(0, prompt)], all_logits=True)[0]
    np.testing.assert_allclose(logits, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- Mistral's window, long sequences
@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Mistral with sliding_window 8 (transformers model, our LoadedModel)."""
    path = tmp_path_factory.mktemp("tiny_mistral_window")
    hf_model = make_tiny_hf_model(path, seed=79, family="mistral", sliding_window=WINDOW)
    write_tiny_tokenizer(path, hf_model.config.vocab_size)
    return hf_model, load_model(path)


def test_the_window_matters_for_these_prompts(windowed):
    """Guard against a vacuous comparison: without the window transformers' logits past position 8 differ."""
    hf_model, loaded = windowed
    prompt = random_prompts(7, [5 * WINDOW], loaded.config.vocab_size)[0]
    hf_model.config.sliding_window = None
    try:
        full = hf_logits(hf_model, prompt)
    finally:
        hf_model.config.sliding_window = WINDOW
    windowed_logits = hf_logits(hf_model, prompt)
    np.testing.assert_allclose(windowed_logits[:WINDOW], full[:WINDOW], atol=ATOL, rtol=0)
    assert np.abs(windowed_logits[WINDOW:] - full[WINDOW:]).max(axis=1).min() > 1e-2


@pytest.mark.parametrize("block_size,chunk", [(4, 5), (16, 7), (4, None), (3, 8)])
def test_window_chunked_prefill_and_decode_over_several_windows(windowed, block_size, chunk):
    """Prompts of 1.6 to 5 windows prefilled in chunks (None: at once), with a decode batched in, then
    decoded 12 steps: every row within 1e-4 of transformers."""
    hf_model, loaded = windowed
    prompts = random_prompts(8, [5 * WINDOW, 2 * WINDOW + 1, 13, 3 * WINDOW + 5], loaded.config.vocab_size)
    refs = [hf_logits(hf_model, p) for p in prompts]
    runner = _runner(loaded, block_size=block_size, seed=block_size)
    decoded_from = [len(p) - 12 for p in prompts]
    step = chunk or max(decoded_from)
    got = [[] for _ in prompts]
    for start in range(0, max(decoded_from), step):
        part = [(i, p[start:min(start + step, decoded_from[i])]) for i, p in enumerate(prompts)
                if start < decoded_from[i]]
        for (i, _), logits in zip(part, runner.step(part, all_logits=True)):
            got[i].append(logits)
    for back in range(12, 0, -1):
        rows = runner.step([(i, [p[-back]]) for i, p in enumerate(prompts)])
        for i, row in enumerate(rows):
            got[i].append(row[None])
    for i, ref in enumerate(refs):
        np.testing.assert_allclose(np.concatenate(got[i]), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_window_engine_under_preemption_equals_generate(windowed, mode):
    """Prompts 2-4 windows long, two sharing a 16-token prefix (prefix-cache hits), through a pool too
    small for all of them (preemption by `mode`): greedy output equal to transformers' generate."""
    hf_model, loaded = windowed
    prompts = random_prompts(9, [20, 25, 30, 17], loaded.config.vocab_size)
    prompts[1][:16] = prompts[0][:16]
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float64", block_size=4, num_kv_blocks=24,
                                    num_cpu_blocks=64, preemption_mode=mode, max_num_seqs=4,
                                    max_num_batched_tokens=16), loaded_model=loaded)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert engine.stats.num_preemptions > 0
    want = _hf_greedy(hf_model, prompts, 12)
    assert [got[str(i)].outputs[0].token_ids for i in range(len(prompts))] == want
