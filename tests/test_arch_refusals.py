"""Qwen2 / Qwen3 / Mistral configs and checkpoints that we would not compute exactly: each is one
ValueError naming the file and the field or tensor. Plus the transformers defaults a config may omit."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from offline_paged.models.config import LlamaConfig
from offline_paged.models.loader import load_model
from tiny_llama import TINY, make_tiny_hf_model, write_tiny_tokenizer

QWEN2 = TINY | dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                    use_sliding_window=False, sliding_window=None, max_window_layers=28)
QWEN3 = QWEN2 | dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=12)
MISTRAL = TINY | dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)

BAD_CONFIGS = {
    "qwen2_window_on_every_layer": (QWEN2 | {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
                                    r"sliding-window attention is not supported: use_sliding_window is true, so "
                                    r"layers 0\.\.2 \(max_window_layers 0\) would attend within sliding_window 4"),
    "qwen3_window_default_size": (QWEN3 | {"use_sliding_window": True, "max_window_layers": 2, "sliding_window": 4096},
                                  r"use_sliding_window is true, so layers 2\.\.2 .* sliding_window 4096"),
    "qwen3_window_missing_size": ({k: v for k, v in QWEN3.items() if k != "sliding_window"}
                                  | {"use_sliding_window": True, "max_window_layers": 1},
                                  r"layers 1\.\.2 \(max_window_layers 1\) would attend within sliding_window 4096"),
    "qwen3_layer_types_sliding": (QWEN3 | {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
                                  r"layer_types marks layers \[1\] as sliding_attention"),
    "qwen2_layer_types_bad": (QWEN2 | {"layer_types": ["full_attention"]},
                              r"layer_types must list full_attention or sliding_attention for each of the 3 layers"),
    "qwen2_use_sliding_window_string": (QWEN2 | {"use_sliding_window": "yes", "sliding_window": 8},
                                        r"use_sliding_window must be true or false"),
    "qwen3_attention_bias": (QWEN3 | {"attention_bias": True}, r"attention_bias / mlp_bias are not supported"),
    "qwen2_yarn": (QWEN2 | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768}},
                   r"unsupported rope scaling type 'yarn'"),
    "qwen3_gelu": (QWEN3 | {"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    "qwen2_quantized": (QWEN2 | {"quantization_config": {"quant_method": "awq"}},
                        r"quantization_config \(quant_method 'awq'\) is not supported"),
    "mistral_window_zero": (MISTRAL | {"sliding_window": 0}, r"sliding_window must be a positive integer or null, got '0'"),
    "mistral_window_string": (MISTRAL | {"sliding_window": "4096"},
                              r"sliding_window must be a positive integer or null, got '4096'"),
    "mistral_window_float": (MISTRAL | {"sliding_window": 8.5}, r"sliding_window must be a positive integer"),
    "unknown_model_type": ({k: v for k, v in QWEN2.items() if k != "architectures"} | {"model_type": "gemma"},
                           r"no 'architectures' and unknown model_type 'gemma'"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_refused_by_name(tmp_path, name):
    raw, message = BAD_CONFIGS[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config\.json: .*" + message):
        LlamaConfig.from_file(path)


def test_transformers_defaults_fill_what_config_json_leaves_out():
    qwen3 = LlamaConfig.from_dict({k: v for k, v in QWEN3.items() if k not in ("head_dim", "rms_norm_eps")})
    assert qwen3.head_dim == 128 and qwen3.rms_norm_eps == 1e-6  # Qwen3Config's defaults, not hidden / heads
    qwen2 = LlamaConfig.from_dict({k: v for k, v in QWEN2.items() if k not in ("head_dim", "max_position_embeddings")})
    assert qwen2.head_dim == 8 and qwen2.max_position_embeddings == 32768
    by_type = LlamaConfig.from_dict({k: v for k, v in QWEN3.items() if k != "architectures"})
    assert by_type.architecture == "Qwen3ForCausalLM"


def test_windows_that_no_layer_uses_are_accepted():
    """transformers gives no layer a window here, so full attention is exactly what it computes."""
    assert LlamaConfig.from_dict(QWEN2 | {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 3})
    assert LlamaConfig.from_dict(QWEN3 | {"layer_types": ["full_attention"] * 3, "sliding_window": 4})
    assert LlamaConfig.from_dict(QWEN2 | {"use_sliding_window": False, "sliding_window": 131072})


def test_mistral_window_is_read_with_transformers_default():
    """Mistral's window is computed now: the key's value, none for null, MistralConfig's 4096 when absent."""
    assert LlamaConfig.from_dict(MISTRAL | {"sliding_window": 8}).sliding_window == 8
    assert LlamaConfig.from_dict(MISTRAL).sliding_window is None
    absent = LlamaConfig.from_dict({k: v for k, v in MISTRAL.items() if k != "sliding_window"})
    assert absent.sliding_window == 4096


def test_a_window_on_another_architecture_is_refused():
    """Only Mistral's every-layer window is computed; a Llama or Qwen config object cannot carry one."""
    import dataclasses

    for raw in (TINY | {"architectures": ["LlamaForCausalLM"]}, QWEN2):
        with pytest.raises(ValueError, match=r"sliding_window is not computed for (Llama|Qwen2)ForCausalLM"):
            dataclasses.replace(LlamaConfig.from_dict(raw), sliding_window=8)
    # Llama's config.json has no window key: a stray one is not read (transformers' Llama ignores it too).
    assert LlamaConfig.from_dict(TINY | {"architectures": ["LlamaForCausalLM"], "sliding_window": 8}).sliding_window is None


def test_config_round_trips_per_architecture():
    for raw in (QWEN2, QWEN3, MISTRAL, MISTRAL | {"sliding_window": 8}):
        config = LlamaConfig.from_dict(raw)
        assert LlamaConfig.from_dict(config.to_dict()) == config


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a saved tiny transformers checkpoint directory."""
    dirs = {}
    for family in ("qwen2", "qwen3"):
        path = tmp_path_factory.mktemp(family)
        make_tiny_hf_model(path, seed=9, family=family)
        write_tiny_tokenizer(path, TINY["vocab_size"])
        dirs[family] = path
    return dirs


def _copy(saved, family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(saved[family], dst)
    return dst


def _edit_weights(directory, drop=(), **replace):
    weights = {k: v for k, v in load_file(directory / "model.safetensors").items() if k not in drop}
    save_file(weights | replace, str(directory / "model.safetensors"))


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | changes))


WHERE = r"config\.json; model\.safetensors\): "


def test_qwen2_without_a_q_bias_is_refused(saved, tmp_path):
    directory = _copy(saved, "qwen2", tmp_path)
    _edit_weights(directory, drop=["model.layers.1.self_attn.q_proj.bias"])
    with pytest.raises(ValueError, match=WHERE + r"missing tensors \['model\.layers\.1\.self_attn\.q_proj\.bias'\]"):
        load_model(directory)


def test_qwen3_without_q_norm_is_refused(saved, tmp_path):
    directory = _copy(saved, "qwen3", tmp_path)
    _edit_weights(directory, drop=["model.layers.0.self_attn.q_norm.weight"])
    with pytest.raises(ValueError, match=WHERE + r"missing tensors \['model\.layers\.0\.self_attn\.q_norm\.weight'\]"):
        load_model(directory)


def test_qwen3_with_biases_is_refused(saved, tmp_path):
    directory = _copy(saved, "qwen3", tmp_path)
    _edit_weights(directory, **{"model.layers.2.self_attn.k_proj.bias": np.zeros(24, np.float32)})
    with pytest.raises(ValueError, match=WHERE + r"unexpected tensors \['model\.layers\.2\.self_attn\.k_proj\.bias'\]"
                                              r": a Qwen3ForCausalLM as configured does not use them"):
        load_model(directory)


@pytest.mark.parametrize("relabel,message", [
    ("LlamaForCausalLM", r"unexpected tensors \['model\.layers\.0\.self_attn\.k_proj\.bias'"),
    ("Qwen3ForCausalLM", r"missing tensors \['model\.layers\.0\.self_attn\.k_norm\.weight'"),
])
def test_relabelled_qwen2_checkpoint_is_refused(saved, tmp_path, relabel, message):
    directory = _copy(saved, "qwen2", tmp_path)
    _edit_config(directory, architectures=[relabel], head_dim=8)
    with pytest.raises(ValueError, match=WHERE + message):
        load_model(directory)


def test_qwen3_head_dim_left_out_is_128_and_refused_by_shape(saved, tmp_path):
    """A Qwen3 config.json without head_dim means 128 (not hidden / heads), which these tensors are not."""
    directory = _copy(saved, "qwen3", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["head_dim"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.q_proj\.weight has "
                                         r"shape \(72, 48\), expected \(768, 48\) from config\.json"):
        load_model(directory)


def test_wrong_bias_shape_is_named(saved, tmp_path):
    directory = _copy(saved, "qwen2", tmp_path)
    _edit_weights(directory, **{"model.layers.0.self_attn.v_proj.bias": np.zeros(48, np.float32)})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.self_attn\.v_proj\.bias has shape \(48,\), "
                                         r"expected \(16,\)"):
        load_model(directory)


# --------------------------------------------------------------------------- published configs
# config.json of Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen3-0.6B as published (a window is present but off).
QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("raw,preset", [(QWEN25_7B_INSTRUCT, "qwen2.5-7b"), (QWEN3_06B, "qwen3-0.6b")])
def test_published_configs_load_as_the_bench_presets(raw, preset):
    import dataclasses

    from offline_paged.models.dummy_weights import PRESETS

    config = LlamaConfig.from_dict(raw)
    # The presets also stop on generation_config.json's extra end-of-sequence ids.
    assert dataclasses.replace(config, eos_token_ids=PRESETS[preset].eos_token_ids) == PRESETS[preset]


# config.json of mistralai/Mistral-7B-v0.1 as published: a 4096-token window on every layer.
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}


def test_published_mistral_config_reads_its_window():
    config = LlamaConfig.from_dict(MISTRAL_7B_V01)
    assert (config.sliding_window, config.head_dim, config.max_position_embeddings) == (4096, 128, 32768)
    assert (config.bos_token_id, config.eos_token_ids, config.tie_word_embeddings) == (1, (2,), False)


def test_published_mistral_config_loads_as_the_bench_preset():
    from offline_paged.models.dummy_weights import PRESETS

    assert LlamaConfig.from_dict(MISTRAL_7B_V01) == PRESETS["mistral-7b"]
