"""entrypoints.llm_args: vLLM's LLM(...) arguments mapped onto EngineConfig, the rest refused by name."""
from __future__ import annotations

import pytest

from offline_paged.core.config import EngineConfig
from offline_paged.entrypoints.llm_args import engine_kwargs


@pytest.mark.parametrize("dtype, ours", [("auto", None), ("half", "float16"), ("float", "float32"),
                                         ("bfloat16", "bfloat16"), ("float64", "float64"), (None, None)])
def test_dtype_aliases(dtype, ours):
    config = engine_kwargs("m", dtype, {}).config
    assert config == {"model": "m", "dtype": ours}


def test_vllm_spellings_become_engine_fields_and_the_result_builds_an_engine_config():
    args = engine_kwargs(None, "float", {
        "enforce_eager": True, "kv_cache_memory_bytes": 1 << 20, "seed": None, "max_num_seqs": 7,
        "generation_config": "vllm", "pipeline_parallel_size": 1, "trust_remote_code": False,
        "disable_log_stats": True, "enable_chunked_prefill": False, "tokenizer": None})
    config, generation_config = args.config, args.generation_config
    assert config == {"model": None, "dtype": "float32", "cuda_graphs": False, "kv_cache_memory": 1 << 20,
                      "seed": 0, "max_num_seqs": 7}
    assert generation_config == "vllm"
    engine_config = EngineConfig(**config)
    assert engine_config.max_num_seqs == 7 and engine_config.cuda_graphs is False


def test_generation_config_defaults_to_auto_and_must_be_a_string():
    assert engine_kwargs("m", None, {}).generation_config == "auto"
    with pytest.raises(ValueError, match="generation_config must be one of"):
        engine_kwargs("m", None, {"generation_config": {"temperature": 0}})


@pytest.mark.parametrize("kwargs, message", [
    ({"pipeline_parallel_size": 2}, r"pipeline_parallel_size is not supported \(only pipeline_parallel_size=1\)"),
    ({"runner": "draft"}, r"runner='draft' is not supported"),
    ({"swap_space": "4"}, r"swap_space is in GiB"),
    ({"tokenizer": "other/tok"}, r"tokenizer='other/tok' is not supported"),
    ({"enable_prefix_caching": True, "lora_modules": [], "speculative_config": {}},
     r"LLM argument\(s\) lora_modules, speculative_config not supported by offline-paged"),
])
def test_unsupported_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_kwargs("m", None, kwargs)


def test_the_tokenizer_may_name_the_model_itself():
    assert engine_kwargs("m", None, {"tokenizer": "m"}).config == {"model": "m", "dtype": None}


def test_swap_space_is_gib_as_in_vllm():
    assert engine_kwargs("m", None, {"swap_space": 4}).config["swap_space"] == 4 << 30
    assert engine_kwargs("m", None, {"swap_space": 0.5}).config["swap_space"] == 1 << 29


def test_vllm_pooling_and_hub_arguments_are_kept_for_llm():
    args = engine_kwargs("Org/M", None, {"runner": "pooling", "task": "embed", "trust_remote_code": True,
                                         "revision": "v2", "served_model_name": ["served"],
                                         "pooler_config": {"pooling_type": "MEAN"}})
    assert args.config == {"model": "Org/M", "dtype": None}
    assert (args.revision, args.served_model_name, args.pooler_config) == ("v2", "served", {"pooling_type": "MEAN"})


def test_the_fp8_kv_cache_arguments_are_vllms_names():
    args = engine_kwargs(None, None, {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True})
    config = EngineConfig(**args.config)
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("fp8_e4m3", True)
