"""config.json: every hostile or unsupported value is one ValueError naming the file and the field,
raised at load (never a traceback, never NaN logits later)."""
from __future__ import annotations

import json

import pytest

from offline_paged.models.config import LlamaConfig, RopeScaling

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=48, intermediate_size=80,
            num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False,
            hidden_act="silu")

HOSTILE = {
    "layers_1e9": ({"num_hidden_layers": 10**9}, r"num_hidden_layers must be an integer in 1\.\.1024"),
    "heads_zero": ({"num_attention_heads": 0, "head_dim": None}, r"num_attention_heads must be an integer in"),
    "kv_heads_zero": ({"num_key_value_heads": 0}, r"num_key_value_heads must be an integer in"),
    "heads_string": ({"num_attention_heads": "6"}, r"num_attention_heads must be an integer, got '6'"),
    "layers_float": ({"num_hidden_layers": 3.5}, r"num_hidden_layers must be an integer, got '3\.5'"),
    "vocab_bool": ({"vocab_size": True}, r"vocab_size must be an integer, got 'True'"),
    "eps_negative": ({"rms_norm_eps": -1}, r"rms_norm_eps must be a finite number > 0, got -1\.0"),
    "eps_zero": ({"rms_norm_eps": 0}, r"rms_norm_eps must be a finite number > 0"),
    "eps_string": ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps must be a number"),
    "eps_huge_int": ({"rms_norm_eps": 10**400}, r"rms_norm_eps must be a finite number"),
    "theta_zero": ({"rope_theta": 0}, r"rope_theta must be a finite number > 0, got 0\.0"),
    "theta_in_parameters": ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}, r"rope_theta must be"),
    "rope_scaling_string": ({"rope_scaling": "yarn"}, r"rope_scaling must be an object or null, got 'yarn'"),
    "rope_yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                  r"unsupported rope scaling type 'yarn' in rope_scaling"),
    "rope_dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"unsupported rope scaling type 'dynamic'"),
    "rope_factor_zero": ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, r"rope scaling factor must be"),
    "rope_no_factor": ({"rope_scaling": {"rope_type": "linear"}},
                       r"rope_scaling: rope scaling 'linear' needs a 'factor'"),
    "llama3_equal_factors": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                               "high_freq_factor": 4.0}},
                             r"rope scaling high_freq_factor \(4\.0\) must be greater"),
    "partial_rotary": ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0\.5 is not supported"),
    "hidden_act": ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(this decoder computes silu\)"),
    "quantized": ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
                  r"quantization_config \(quant_method 'gptq'\) is not supported"),
    "attention_bias": ({"attention_bias": True}, r"attention_bias / mlp_bias are not supported"),
    "tie_string": ({"tie_word_embeddings": "no"}, r"tie_word_embeddings must be true or false"),
    "bos_outside_vocab": ({"bos_token_id": 10**9}, r"bos_token_id 1000000000 is not a token id"),
    "eos_outside_vocab": ({"eos_token_id": [2, 97]}, r"eos_token_id 97 is not a token id"),
    "eos_string": ({"eos_token_id": "</s>"}, r"eos_token_id must be an integer or a list"),
    "max_positions_zero": ({"max_position_embeddings": 0}, r"max_position_embeddings must be an integer in"),
    "odd_head_dim": ({"head_dim": 7}, r"head_dim must be even"),
    "architectures_string": ({"architectures": 5}, r"architectures must be a list of names"),
    "unknown_architecture": ({"architectures": ["GemmaForCausalLM"]}, r"unsupported architecture"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_config_is_one_clear_error(tmp_path, name):
    changes, message = HOSTILE[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BASE | changes))
    with pytest.raises(ValueError, match=r"config\.json: " + message):
        LlamaConfig.from_file(path)


@pytest.mark.parametrize("text,message", [("[1, 2, 3]", "the config must be a JSON object, got list"),
                                          ("[" * 100_000, "not valid JSON"),
                                          ("{nope", "not valid JSON")])
def test_config_that_is_not_an_object(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"config\.json: {message}"):
        LlamaConfig.from_file(path)


def test_base_config_loads_and_round_trips(tmp_path):
    config = LlamaConfig.from_dict(BASE)
    assert config.num_hidden_layers == 3 and config.rope_theta == 500.0
    assert LlamaConfig.from_dict(config.to_dict()) == config
    scaled = LlamaConfig.from_dict(BASE | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert scaled.rope_scaling == RopeScaling("llama3", 8.0)
    assert LlamaConfig.from_dict(BASE | {"max_position_embeddings": 10**9}).max_position_embeddings == 10**9


def test_grammar_mask_processes_default_by_backend_cores_and_loop_and_are_validated():
    from offline_paged.core.config import EngineConfig

    from offline_paged.core.config import auto_grammar_mask_processes

    assert auto_grammar_mask_processes("cuda", 16) == 8
    assert auto_grammar_mask_processes("cuda", 64) == 8
    assert auto_grammar_mask_processes("cuda", 6) == 3
    assert auto_grammar_mask_processes("cuda", 2) == 0  # one process would gain nothing
    assert auto_grammar_mask_processes("cpu", 16) == 0
    config = EngineConfig()
    assert config.resolved_grammar_mask_processes("cuda", True, 16) == 8
    assert config.resolved_grammar_mask_processes("cpu", True, 16) == 0
    assert config.resolved_grammar_mask_processes("cuda", False, 16) == 0  # the sync loop overlaps nothing
    assert EngineConfig(grammar_mask_processes=3).resolved_grammar_mask_processes("cpu", True, 2) == 3
    assert EngineConfig(grammar_mask_processes=3).resolved_grammar_mask_processes("cuda", False, 16) == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="grammar_mask_processes must be a non-negative integer"):
            EngineConfig(grammar_mask_processes=bad)


def test_admission_batch_defaults_by_backend_and_is_validated():
    from offline_paged.core.config import EngineConfig

    assert EngineConfig(max_num_seqs=256).resolved_admission_batch("cuda") == 32
    assert EngineConfig(max_num_seqs=7).resolved_admission_batch("cuda") == 1
    assert EngineConfig(max_num_seqs=256).resolved_admission_batch("cpu") == 1
    assert EngineConfig(admission_batch=5).resolved_admission_batch("cpu") == 5
    with pytest.raises(ValueError, match="admission_batch"):
        EngineConfig(admission_batch=0)


def test_max_model_len_needs_room_for_a_prompt_token_and_one_more():
    from offline_paged.core.config import EngineConfig

    assert EngineConfig(max_model_len=2).max_model_len == 2
    for bad in (1, 0, -3):
        with pytest.raises(ValueError, match="max_model_len must be"):
            EngineConfig(max_model_len=bad)


def test_mixed_graph_tokens_is_a_non_negative_integer_zero_meaning_off():
    from click.testing import CliRunner

    from offline_paged.cli.main import cli
    from offline_paged.core.config import EngineConfig

    assert EngineConfig().mixed_graph_tokens == 2048 and EngineConfig(mixed_graph_tokens=0).mixed_graph_tokens == 0
    for bad in (-1, 2.5, "big", None):
        with pytest.raises(ValueError, match="mixed_graph_tokens must be a non-negative integer"):
            EngineConfig(mixed_graph_tokens=bad)
    result = CliRunner().invoke(cli, ["generate", "--mixed-graph-tokens", "-5", "in.jsonl"])
    assert result.exit_code == 2 and "--mixed-graph-tokens" in result.output


def test_max_num_seqs_defaults_by_backend_and_device_memory_and_is_validated():
    from offline_paged.core.config import GiB, EngineConfig, auto_max_num_seqs

    assert auto_max_num_seqs("cuda", 80 * GiB) == 1024  # an H100
    assert auto_max_num_seqs("cuda", 70 * GiB) == 1024
    assert auto_max_num_seqs("cuda", 70 * GiB - 1) == 256
    assert auto_max_num_seqs("cuda", 24 * GiB) == 256
    assert auto_max_num_seqs("cpu", None) == 256
    assert auto_max_num_seqs("cpu", 1 << 40) == 256  # the CPU's step costs about its sequences
    assert EngineConfig().max_num_seqs is None
    assert EngineConfig().with_device_defaults("cuda", 141 * GiB).max_num_seqs == 1024
    assert EngineConfig().with_device_defaults("cuda", 24 * GiB).max_num_seqs == 256
    assert EngineConfig(max_num_seqs=7).with_device_defaults("cuda", 141 * GiB).max_num_seqs == 7
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_num_seqs"):
            EngineConfig(max_num_seqs=bad)


def test_a_devices_1024_sequences_fall_back_to_512_where_the_kv_pool_is_short():
    from offline_paged.core.config import fit_max_num_seqs

    assert fit_max_num_seqs(1024, 339_296, 2029) == 512  # the 8B on an H100: 331 tokens a sequence
    assert fit_max_num_seqs(1024, 890_000, 2029) == 1024  # the 8B on an H200
    assert fit_max_num_seqs(1024, 1024 * 512, 2029) == 1024 and fit_max_num_seqs(1024, 1024 * 512 - 1, 2029) == 512
    assert fit_max_num_seqs(1024, 1024 * 200, 200) == 1024  # short sequences: max_model_len is enough
    assert fit_max_num_seqs(512, 1000, 2029) == 512 and fit_max_num_seqs(256, 1000, 2029) == 256


def test_the_engine_fits_only_a_max_num_seqs_left_to_the_device(monkeypatch):
    import offline_paged.core.config as config_module
    from tests.tiny_engine import tiny_engine

    from offline_paged.executor.local_executor import LocalExecutor

    monkeypatch.setattr(config_module, "auto_max_num_seqs", lambda backend, memory: 1024)
    runners_for = []  # the max_num_seqs each runner (its graph buckets and sampling rows) was built for
    build = LocalExecutor.init_runner
    monkeypatch.setattr(LocalExecutor, "init_runner",
                        lambda self, *args: runners_for.append(args[-1]) or build(self, *args))
    short = tiny_engine(max_num_seqs=None, num_kv_blocks=1000, max_model_len=64)  # 4,000 tokens
    assert short.config.max_num_seqs == 512 and short.scheduler.max_num_seqs == 512 and runners_for == [512]
    roomy = tiny_engine(max_num_seqs=None, num_kv_blocks=1024 * 16 + 1, max_model_len=64)  # 64 tokens each
    assert roomy.config.max_num_seqs == 1024 and roomy.scheduler.max_num_seqs == 1024
    assert tiny_engine(max_num_seqs=1024, num_kv_blocks=1000, max_model_len=64).config.max_num_seqs == 1024


def test_max_num_batched_tokens_defaults_by_backend_and_is_validated():
    from offline_paged.core.config import GiB, EngineConfig, auto_max_num_batched_tokens

    assert auto_max_num_batched_tokens("cuda") == 8192
    assert auto_max_num_batched_tokens("cpu") == 2048
    assert EngineConfig().max_num_batched_tokens is None
    filled = EngineConfig().with_device_defaults("cuda", 80 * GiB)
    assert (filled.max_num_seqs, filled.max_num_batched_tokens) == (1024, 8192)
    given = EngineConfig(max_num_seqs=3, max_num_batched_tokens=100).with_device_defaults("cuda", 80 * GiB)
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (3, 100)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            EngineConfig(max_num_batched_tokens=bad)


def test_the_engine_resolves_its_device_defaults_before_sizing_anything():
    from tiny_engine import tiny_engine

    engine = tiny_engine(max_num_seqs=None, max_num_batched_tokens=None)
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (256, 2048)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (256, 2048)
    assert engine.config.resolved_admission_batch("cpu") == 1
