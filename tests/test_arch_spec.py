"""arch_spec (models/arch_spec.py): the table of supported architectures, and unsupported names refused
with the supported list."""
from __future__ import annotations

import pytest

from offline_paged.models.arch_spec import (ARCH_SPECS, ARCHITECTURE_OF_MODEL_TYPE, SUPPORTED_ARCHITECTURES,
                                            arch_spec)


def test_every_spec_is_found_by_its_name_and_its_model_type():
    assert SUPPORTED_ARCHITECTURES == tuple(ARCH_SPECS)
    for name in SUPPORTED_ARCHITECTURES:
        spec = arch_spec(name)
        assert spec.architecture == name
        assert ARCHITECTURE_OF_MODEL_TYPE[spec.model_type] == name
    assert len(ARCHITECTURE_OF_MODEL_TYPE) == len(ARCH_SPECS)  # model types are unique


def test_family_flags():
    assert arch_spec("Qwen2ForCausalLM").qkv_bias and not arch_spec("Qwen2ForCausalLM").qk_norm
    assert arch_spec("Qwen3ForCausalLM").qk_norm and arch_spec("Qwen3ForCausalLM").default_head_dim == 128
    llama = arch_spec("LlamaForCausalLM")
    assert not (llama.qkv_bias or llama.qk_norm) and llama.window_switch is None
    assert arch_spec("MistralForCausalLM").window_switch == "sliding_window"


def test_unsupported_architecture_is_refused_with_the_list():
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel' \(supported: "
                                         r"LlamaForCausalLM, .*Qwen3ForCausalLM\)"):
        arch_spec("GPT2LMHeadModel")
