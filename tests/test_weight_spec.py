"""weight_spec: the tensor list per architecture, and the checks that refuse a checkpoint by name."""
from __future__ import annotations

import pytest

from offline_paged.models.config import LlamaConfig
from offline_paged.models.weight_spec import (check_checkpoint_names, check_weights, count_layers,
                                              expected_weight_shapes)

SHAPE = dict(vocab_size=50, hidden_size=16, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=6)


def _config(**overrides) -> LlamaConfig:
    return LlamaConfig(**(SHAPE | overrides))


def test_llama_tensors_have_hf_shapes_out_by_in():
    shapes = expected_weight_shapes(_config())
    assert shapes["model.embed_tokens.weight"] == (50, 16)
    assert shapes["lm_head.weight"] == (50, 16)
    assert shapes["model.layers.2.self_attn.q_proj.weight"] == (4 * 6, 16)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (2 * 6, 16)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 4 * 6)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (16, 40)
    assert len(shapes) == 3 + 3 * 9  # embeddings, final norm, lm_head; nine tensors per layer
    assert not any("bias" in n or "q_norm" in n for n in shapes)


def test_tied_embeddings_have_no_lm_head():
    assert "lm_head.weight" not in expected_weight_shapes(_config(tie_word_embeddings=True))


def test_qwen2_adds_qkv_biases_and_qwen3_adds_per_head_norms():
    qwen2 = expected_weight_shapes(_config(architecture="Qwen2ForCausalLM"))
    assert qwen2["model.layers.0.self_attn.q_proj.bias"] == (24,)
    assert qwen2["model.layers.0.self_attn.v_proj.bias"] == (12,)
    qwen3 = expected_weight_shapes(_config(architecture="Qwen3ForCausalLM"))
    assert qwen3["model.layers.2.self_attn.k_norm.weight"] == (6,)
    assert not any(n.endswith("bias") for n in qwen3)


def test_count_layers_reads_the_highest_index():
    assert count_layers(["model.layers.0.x", "model.layers.11.y", "model.norm.weight"]) == 12
    assert count_layers(["model.norm.weight"]) == 0


def test_a_complete_checkpoint_passes_and_an_inv_freq_buffer_is_ignored():
    names = set(expected_weight_shapes(_config())) | {"model.layers.0.self_attn.rotary_emb.inv_freq"}
    check_checkpoint_names(_config(), names)


@pytest.mark.parametrize("edit, message", [
    (lambda n: n - {"model.layers.1.mlp.up_proj.weight"}, r"missing tensors \['model.layers.1.mlp.up_proj"),
    (lambda n: n | {"model.layers.0.self_attn.q_proj.bias"}, "unexpected tensors .*q_proj.bias.*LlamaForCausalLM"),
    (lambda n: n | {"model.layers.3.mlp.up_proj.weight"}, "num_hidden_layers is 3 .* holds 4 layers"),
    (lambda n: n - {"lm_head.weight"}, "tie_word_embeddings to false"),
])
def test_a_checkpoint_of_another_shape_is_refused_by_name(edit, message):
    names = edit(set(expected_weight_shapes(_config())))
    with pytest.raises(ValueError, match=message):
        check_checkpoint_names(_config(), names)


def test_a_tied_checkpoint_may_carry_a_redundant_lm_head():
    config = _config(tie_word_embeddings=True)
    check_checkpoint_names(config, set(expected_weight_shapes(config)) | {"lm_head.weight"})


def test_check_weights_names_the_wrong_shape_and_the_missing_tensor():
    shapes = expected_weight_shapes(_config())
    check_weights(_config(), shapes | {"extra.buffer": (1,)})
    with pytest.raises(ValueError, match=r"here: tensor model.norm.weight has shape \(15,\), expected \(16,\)"):
        check_weights(_config(), shapes | {"model.norm.weight": (15,)}, where="here")
    del shapes["model.layers.0.input_layernorm.weight"]
    with pytest.raises(ValueError, match=r"weights: missing tensors \['model.layers.0.input_layernorm"):
        check_weights(_config(), shapes)
