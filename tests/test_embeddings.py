"""Embeddings (LLM.embed / LLM.encode, LLMEngine.embed, worker/pooling_runner.py, models/pooling.py):
the vectors equal transformers' final hidden states of tiny random Llama and Qwen3 models pooled the
way the model's sentence-transformers files say (last token, mean, CLS; normalised or not)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_llama import make_tiny_hf_model, random_prompts, write_tiny_tokenizer

from offline_paged import LLM
from offline_paged.models.pooling import PoolingConfig, pool
from offline_paged.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from offline_paged.pooling_params import PoolingParams


def _model(tmp_path_factory, family: str):
    path = tmp_path_factory.mktemp(f"embed-{family}")
    model = make_tiny_hf_model(path, seed=11, family=family)
    write_tiny_tokenizer(path, model.config.vocab_size)
    return path, model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family_model(request, tmp_path_factory):
    return _model(tmp_path_factory, request.param)


def _hf_hidden(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()  # [T, E]


def _expected(model, ids: list[int], pooling_type: str, normalize: bool) -> np.ndarray:
    hidden = _hf_hidden(model, ids)
    vector = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(axis=0)}[pooling_type]
    return vector / np.linalg.norm(vector) if normalize else vector


@pytest.mark.parametrize("pooling_type, normalize", [("LAST", True), ("MEAN", False), ("CLS", True)])
def test_embed_equals_transformers_pooled_hidden_states(family_model, pooling_type, normalize):
    path, model = family_model
    prompts = random_prompts(3, [5, 1, 12, 7], model.config.vocab_size)
    llm = LLM(str(path), device="cpu", dtype="float64", block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=16, pooler_config={"pooling_type": pooling_type, "normalize": normalize})
    outputs = llm.embed(prompts, use_tqdm=False)
    for ids, out in zip(prompts, outputs):
        assert isinstance(out, EmbeddingRequestOutput) and out.prompt_token_ids == ids
        assert out.outputs.hidden_size == model.config.hidden_size
        np.testing.assert_allclose(out.outputs.embedding, _expected(model, ids, pooling_type, normalize),
                                   rtol=1e-5, atol=1e-5)


def test_sentence_transformers_files_choose_the_pooling(tmp_path_factory):
    path, model = _model(tmp_path_factory, "qwen3")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": model.config.hidden_size, "pooling_mode_mean_tokens": True}))
    llm = LLM(str(path), device="cpu", dtype="float64", block_size=4, num_kv_blocks=64)
    ids = random_prompts(4, [9], model.config.vocab_size)[0]
    [out] = llm.encode([ids], use_tqdm=False)
    assert isinstance(out, PoolingRequestOutput) and out.outputs.data.dtype == np.float32
    np.testing.assert_allclose(out.outputs.data, _expected(model, ids, "MEAN", False), rtol=1e-5, atol=1e-5)
    [normed] = llm.embed([ids], PoolingParams(normalize=True), use_tqdm=False)
    np.testing.assert_allclose(normed.outputs.embedding, _expected(model, ids, "MEAN", True), rtol=1e-5, atol=1e-5)


def test_text_prompts_embed_their_token_ids_and_generation_still_runs(family_model):
    path, model = family_model
    llm = LLM(str(path), device="cpu", dtype="float64", block_size=4, num_kv_blocks=64)
    [by_text] = llm.embed("w1 w2 w3", use_tqdm=False)
    [by_ids] = llm.embed([by_text.prompt_token_ids], use_tqdm=False)
    assert by_text.outputs.embedding == by_ids.outputs.embedding
    assert llm.generate("w1 w2", use_tqdm=False)[0].outputs[0].token_ids


def test_bad_prompts_and_unsupported_settings_are_refused(family_model):
    path, model = family_model
    llm = LLM(str(path), device="cpu", dtype="float64", block_size=4, num_kv_blocks=64, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([[1] * 40], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary|prompt_token_ids must be"):
        llm.embed([[model.config.vocab_size]], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task"):
        llm.encode("w1", pooling_task="classify")
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=8)


def test_pooling_config_reads_sentence_transformers_and_refuses_what_it_cannot_compute(tmp_path):
    assert PoolingConfig.from_dir(tmp_path) == PoolingConfig("LAST", True)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert PoolingConfig.from_dir(tmp_path) == PoolingConfig("LAST", True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens is not supported"):
        PoolingConfig.from_dir(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="'Dense' is not supported"):
        PoolingConfig.from_dir(tmp_path)
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingConfig("MAX")


def test_pool_normalises_to_unit_length():
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)  # [T, E]
    assert np.linalg.norm(pool(hidden, PoolingConfig("MEAN", True))) == pytest.approx(1.0)
    np.testing.assert_array_equal(pool(hidden, PoolingConfig("LAST", False)), hidden[-1])


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def cuda_family_model(request, tmp_path_factory):
    """A tiny model of the family with head dim 64 (the CUDA attention kernels exist for 64 and 128)."""
    path = tmp_path_factory.mktemp(f"embed-cuda-{request.param}")
    model = make_tiny_hf_model(path, seed=11, family=request.param, head_dim=64)
    write_tiny_tokenizer(path, model.config.vocab_size)
    return path, model


@pytest.mark.gpu
def test_cuda_embeddings_match_the_cpu_reference(cuda_family_model):
    """The pooling forward on the CUDA backend (fp16) agrees with the NumPy float64 one, for a prompt
    longer than the token budget (it runs alone) too."""
    path, model = cuda_family_model
    prompts = random_prompts(5, [3, 17, 40], model.config.vocab_size)
    reference = LLM(str(path), device="cpu", dtype="float64", num_kv_blocks=64).embed(prompts, use_tqdm=False)
    cuda = LLM(str(path), device="cuda", dtype="float16", num_kv_blocks=64, max_num_batched_tokens=32)
    for ours, ref in zip(cuda.embed(prompts, use_tqdm=False), reference):
        np.testing.assert_allclose(ours.outputs.embedding, ref.outputs.embedding, atol=2e-2)
    assert cuda.generate("w1 w2", use_tqdm=False)[0].outputs[0].token_ids  # generation still runs after
