"""The RoPE table is built for the engine's max_model_len, never from max_position_embeddings alone."""
from __future__ import annotations

import numpy as np

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.models.config import LlamaConfig
from offline_paged.models.rope import cos_sin_cache
from tiny_engine import run_to_completion, tiny_engine, tiny_model


def test_huge_max_position_embeddings_builds_only_max_model_len_rows(monkeypatch):
    import offline_paged.models.llama as llama

    built = []  # the row count of every table built: bounded by counting, not by time

    def counting_cos_sin_cache(config, dtype, max_positions):
        built.append(max_positions)
        assert max_positions <= 10**5, f"a RoPE table of {max_positions} rows was asked for"  # fail fast, not OOM
        return cos_sin_cache(config, dtype, max_positions)

    monkeypatch.setattr(llama, "cos_sin_cache", counting_cos_sin_cache)
    engine = tiny_engine(tiny_model(max_position_embeddings=10**9))  # 10**9 rows would be 32+ GB
    assert engine.runner.model.cos_sin_cache.shape == (engine.max_model_len, 8)
    assert engine.max_model_len <= 256 * 4  # capped by the KV pool of the test engine
    assert built and max(built) <= max(engine.max_model_len, engine.config.max_num_batched_tokens)
    out = run_to_completion(engine, {"a": ([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))})
    assert len(out["a"].outputs[0].token_ids) == 3


def test_max_model_len_beyond_max_position_embeddings_has_rope_for_every_position():
    engine = tiny_engine(tiny_model(max_position_embeddings=16), max_model_len=40)
    assert engine.runner.model.cos_sin_cache.shape[0] == 40
    out = run_to_completion(engine, {"a": (list(range(5, 35)), SamplingParams(max_tokens=8, temperature=0,
                                                                               ignore_eos=True))})
    assert len(out["a"].outputs[0].token_ids) == 8


def test_table_prefix_is_the_same_whatever_its_length():
    config = LlamaConfig(vocab_size=10, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8, rope_theta=1e4)
    np.testing.assert_array_equal(cos_sin_cache(config, np.float32, 64)[:10], cos_sin_cache(config, np.float32, 10))
