"""Qwen2 (q/k/v bias), Qwen3 (per-head q/k norm, explicit head_dim) and Mistral (no window) through our
one decoder vs transformers' own classes on tiny random models: logits through shuffled block tables,
decode, chunked prefill and a mixed batch; greedy continuations through the engine vs `generate`."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.config import EngineConfig
from offline_paged.engine import LLMEngine
from offline_paged.models.llama import Llama
from offline_paged.models.loader import load_model
from offline_paged.models.ops_numpy import NumpyOps
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.sampling_params import SamplingParams
from tiny_engine import run_to_completion
from tiny_llama import hf_logits, make_tiny_hf_model, random_prompts, write_tiny_tokenizer

FAMILIES = ["qwen2", "qwen3", "mistral"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    """(family, transformers model in float32, our LoadedModel read back through the loader)."""
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    hf_model = make_tiny_hf_model(path, seed=77, family=request.param)
    write_tiny_tokenizer(path, hf_model.config.vocab_size)
    return request.param, hf_model, load_model(path)


def _runner(loaded, block_size: int = 5, seed: int = 0) -> SimpleRunner:
    return SimpleRunner(Llama(loaded.config, loaded.weights, NumpyOps()), 200, block_size, seed=seed)


def test_the_loader_reads_the_architecture(tiny):
    family, hf_model, loaded = tiny
    assert loaded.config.architecture == type(hf_model).__name__
    assert loaded.config.head_dim == hf_model.config.head_dim
    extra = {"qwen2": "model.layers.0.self_attn.k_proj.bias", "qwen3": "model.layers.0.self_attn.k_norm.weight"}
    assert family == "mistral" or extra[family] in loaded.weights


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
    hf64 = hf_model.to(torch.float64)
    eos = hf64.generation_config.eos_token_id
    hf64.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens would mask EOS instead)
    try:
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            with torch.no_grad():  # an explicit mask: generate would mask prompt tokens equal to pad_token_id
                out = hf64.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                    do_sample=False, pad_token_id=0)
            assert got[str(i)].outputs[0].token_ids == out[0, len(prompt):].tolist()
    finally:
        hf_model.to(torch.float32)
        hf64.generation_config.eos_token_id = eos


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("qwen3", True)])
def test_bfloat16_checkpoint_matches_transformers(tmp_path, family, tied):
    """A bf16 save_pretrained (biases and q/k norms in bf16 too) loads, widened, to transformers' logits;
    the Qwen3 one ties its embeddings, as Qwen3-0.6B does."""
    import torch

    hf_model = make_tiny_hf_model(tmp_path, seed=78, family=family, dtype=torch.bfloat16,
                                  tie_word_embeddings=tied)
    assert hf_model.config.tie_word_embeddings == tied
    write_tiny_tokenizer(tmp_path, hf_model.config.vocab_size)
    loaded = load_model(tmp_path)
    assert loaded.config.tie_word_embeddings == tied
    prompt = random_prompts(6, [14], loaded.config.vocab_size)[0]
    logits = _runner(loaded).step([(0, prompt)], all_logits=True)[0]
    np.testing.assert_allclose(logits, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)
