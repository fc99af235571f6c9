"""Dummy weights (models/dummy_weights.py): preset shapes, seeded HF-style values, published parameter
counts, the Qwen presets' extra tensors, and unknown presets refused with the list."""
import numpy as np
import pytest

from offline_paged.models.dummy_weights import PRESETS, dummy_model, num_parameters, random_weights
from offline_paged.models.weight_spec import expected_weight_shapes


def test_dummy_weights_have_the_preset_shapes_and_are_seeded():
    config = PRESETS["smollm2-135m"]
    a = dummy_model("smollm2-135m", np, np.float16, seed=3)
    expected = expected_weight_shapes(config)
    assert {n: w.shape for n, w in a.weights.items()} == expected
    assert all(w.dtype == np.float16 for w in a.weights.values())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert np.array_equal(a.weights[name], dummy_model("smollm2-135m", np, np.float16, seed=3).weights[name])
    assert not np.array_equal(a.weights[name], dummy_model("smollm2-135m", np, np.float16, seed=4).weights[name])
    assert np.all(a.weights["model.norm.weight"] == 1)
    assert 0.015 < float(a.weights[name].astype(np.float32).std()) < 0.025
    assert 130e6 < num_parameters(config) < 140e6


def test_dummy_presets_match_their_published_sizes():
    assert 1.2e9 < num_parameters(PRESETS["llama-3.2-1b"]) < 1.3e9
    assert 8.0e9 < num_parameters(PRESETS["llama-3.1-8b"]) < 8.1e9
    assert 0.59e9 < num_parameters(PRESETS["qwen3-0.6b"]) < 0.60e9  # tied: 0.44B + 0.16B embeddings
    assert 7.6e9 < num_parameters(PRESETS["qwen2.5-7b"]) < 7.7e9


@pytest.mark.parametrize("preset,extra", [("qwen3-0.6b", "model.layers.0.self_attn.k_norm.weight"),
                                          ("qwen2.5-7b", "model.layers.0.self_attn.k_proj.bias")])
def test_qwen_presets_draw_their_extra_tensors_and_run(preset, extra):
    """The preset's heads and head_dim with one layer and small hidden, intermediate and vocabulary
    sizes (the full layer would lift this process's peak RSS by GBs, and with it every later
    subprocess's ru_maxrss): the extra tensors are drawn, the config survives config.json, and a
    forward gives finite logits."""
    import dataclasses

    from offline_paged.models.config import LlamaConfig
    from offline_paged.models.llama import Llama
    from offline_paged.ops.ops_numpy import NumpyOps
    from offline_paged.models.simple_runner import SimpleRunner

    config = dataclasses.replace(PRESETS[preset], num_hidden_layers=1, vocab_size=1024, hidden_size=256,
                                 intermediate_size=512, bos_token_id=1, eos_token_ids=(2,))
    assert LlamaConfig.from_dict(config.to_dict()) == config
    weights = random_weights(config, np, np.float32, seed=1)
    assert extra in weights and np.all(weights.get("model.layers.0.self_attn.k_norm.weight", 1) == 1)
    logits = SimpleRunner(Llama(config, weights, NumpyOps()), 8, 16).step([(0, [5, 6, 7])])[0]
    assert logits.shape == (1024,) and np.all(np.isfinite(logits))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="smollm2-135m"):
        dummy_model("gpt-5")


def test_dummy_tokenizer_refuses_text_and_decodes_to_nothing():
    from offline_paged.models.dummy_weights import DummyTokenizer

    tok = DummyTokenizer((2, 5))
    assert tok.eos_token_ids == frozenset({2, 5}) and tok.decode([7, 8]) == ""
    with pytest.raises(ValueError, match="no tokenizer; give prompts as prompt_token_ids"):
        tok.encode("hi")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
