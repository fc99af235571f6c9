"""CheckpointSource (models/tp_source.py): a rank's shard read from a checkpoint on disk equals the
slice of the fully loaded model."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.tp_shard import shard_config, shard_weights


@pytest.mark.parametrize("bf16", [False, True])
def test_checkpoint_source_reads_memory_mapped_slices_equal_to_the_loaded_model(tmp_path, bf16):
    """CheckpointSource slices memory-mapped views (BF16 widened after slicing); every rank's shard equals
    the slice of the fully loaded checkpoint."""
    import torch

    from offline_paged.models.loader import load_model
    from offline_paged.models.tp_source import CheckpointSource
    from offline_paged.models.tp_views import TensorView, checkpoint_views
    from tiny_llama import make_tiny_hf_model, write_tiny_tokenizer

    make_tiny_hf_model(tmp_path, family="qwen2", dtype=torch.bfloat16 if bf16 else None)
    write_tiny_tokenizer(tmp_path, 97)
    loaded = load_model(tmp_path)
    source = CheckpointSource(str(tmp_path))
    assert isinstance(checkpoint_views(tmp_path, loaded.config)["lm_head.weight"], TensorView)
    for rank in range(2):
        local, shard = source.shard(rank, 2)
        assert local == shard_config(loaded.config, 2)
        want = shard_weights(loaded.config, loaded.weights, rank, 2)
        assert shard.keys() == want.keys()
        for name in want:
            assert shard[name].dtype == np.float32
            np.testing.assert_array_equal(shard[name], want[name], err_msg=name)


def test_dummy_source_full_on_host_slices_the_whole_model_and_pickles_small():
    import pickle

    from offline_paged.models.dummy_weights import random_weights
    from offline_paged.models.tp_source import DummySource

    source = DummySource("tiny", seed=6, full_on_host=True)
    full = random_weights(source.config, np, np.float32, 6)
    for rank in range(2):
        local, shard = source.shard(rank, 2)
        assert local == shard_config(source.config, 2)
        want = shard_weights(source.config, full, rank, 2)
        for name in want:
            np.testing.assert_array_equal(shard[name], want[name], err_msg=name)
    per_rank = DummySource("tiny", seed=6)
    a, b = per_rank.shard(0, 2)[1], per_rank.shard(1, 2)[1]
    name = "model.layers.0.mlp.down_proj.weight"
    assert a[name].shape == b[name].shape and not np.array_equal(a[name], b[name])  # each rank its own draw
    assert len(pickle.dumps(source)) < 500  # a description crosses to the ranks, not weights


def test_as_source_picks_the_source():
    from types import SimpleNamespace

    from offline_paged.models.tp_source import ArraySource, CheckpointSource, DummySource, as_source

    assert as_source(None, "some/dir") == CheckpointSource("some/dir")
    dummy = DummySource("tiny")
    assert as_source(dummy, None) is dummy
    loaded = SimpleNamespace(config="c", weights={"w": 1}, tokenizer="t")
    assert as_source(loaded, None) == ArraySource("c", {"w": 1}, "t")
