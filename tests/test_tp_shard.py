"""shard_weights / shard_config (models/tp_shard.py): the Megatron split of every tensor, read slice by
slice, and the splits that do not divide refused by name. The sharded forward pass itself:
test_tensor_parallel.py."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.tp_shard import shard_config, shard_weights

from test_tensor_parallel import random_model


def test_shard_slices_are_the_megatron_split():
    config, weights = random_model("Qwen2ForCausalLM", 97)
    shard = shard_weights(config, weights, 1, 2)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(shard["model.layers.0.self_attn.q_proj.weight"], q[32:64])
    np.testing.assert_array_equal(shard["model.layers.0.self_attn.k_proj.bias"],
                                  weights["model.layers.0.self_attn.k_proj.bias"][16:32])
    np.testing.assert_array_equal(shard["model.layers.0.mlp.down_proj.weight"],
                                  weights["model.layers.0.mlp.down_proj.weight"][:, 32:64])
    embed = shard["model.embed_tokens.weight"]
    assert embed.shape == (49, 48)
    np.testing.assert_array_equal(embed[:48], weights["model.embed_tokens.weight"][49:])
    assert not embed[48].any()  # the padding row
    assert shard_config(config, 2).num_key_value_heads == 2


def test_shard_reads_only_its_slices():
    """shard_weights slices the views it is given; it never converts a whole tensor."""
    config, weights = random_model()
    touched: list[tuple[str, object]] = []

    class View:
        def __init__(self, name, array):
            self.name, self.array, self.shape = name, array, array.shape

        def __getitem__(self, index):
            touched.append((self.name, index))
            return self.array[index]

    shard_weights(config, {n: View(n, w) for n, w in weights.items()}, 0, 2)
    sliced = {n for n, _ in touched}
    assert "model.layers.0.self_attn.o_proj.weight" in sliced and "model.embed_tokens.weight" in sliced
    assert all(index != slice(None) for _, index in touched)


@pytest.mark.parametrize("overrides, field", [
    (dict(num_attention_heads=6, num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_attention_heads=9, num_key_value_heads=9, head_dim=8), "num_attention_heads"),
    (dict(intermediate_size=63), "intermediate_size"),
])
def test_refuses_splits_that_do_not_divide(overrides, field):
    config, weights = random_model(**overrides)
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2 does not divide {field}"):
        shard_config(config, 2)
    with pytest.raises(ValueError, match=f"does not divide {field}"):
        shard_weights(config, weights, 0, 2)


def test_refuses_bad_rank_and_size():
    config, weights = random_model()
    with pytest.raises(ValueError, match="rank must be an integer in 0..1"):
        shard_weights(config, weights, 2, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        shard_config(config, 0)
