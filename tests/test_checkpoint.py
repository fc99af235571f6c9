"""Checkpoint (models/checkpoint.py): the shards of an HF directory found (index or glob), lazy views with
header shapes and dtypes, and bad shard layouts refused naming the files."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from offline_paged.models.checkpoint import open_checkpoint
from offline_paged.models.loader import load_model

from test_loader import copy_dir, tiny_dir  # noqa: F401 (fixtures)


def test_views_shapes_dtypes_and_sizes_come_from_the_headers(tmp_path):
    rng = np.random.default_rng(31)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal(7).astype(ml_dtypes.bfloat16)}
    save_file({"c": rng.standard_normal((2, 2)).astype(np.float16)}, str(tmp_path / "model-2.safetensors"))
    save_file(tensors, str(tmp_path / "model-1.safetensors"))
    ckpt = open_checkpoint(tmp_path)
    assert sorted(ckpt) == ["a", "b", "c"] and len(ckpt) == 3
    assert ckpt.files["c"].path.name == "model-2.safetensors"
    assert (ckpt.shape("a"), ckpt.dtype("a"), ckpt.dtype("b")) == ((3, 5), np.float32, ml_dtypes.bfloat16)
    np.testing.assert_array_equal(ckpt["a"][1:, 2:], tensors["a"][1:, 2:])
    np.testing.assert_array_equal(ckpt["b"].astype(np.float32), tensors["b"].astype(np.float32))
    assert ckpt.nbytes() == 15 * 4 + 7 * 2 + 4 * 2 and ckpt.nbytes(["b"]) == 14
    assert ckpt.largest_shard_bytes() == max(p.stat().st_size for p in tmp_path.glob("*.safetensors"))


def test_index_naming_a_missing_shard_and_an_empty_directory(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"index\.json: lists shards that do not exist: .*gone\.safetensors"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"index\.json: malformed safetensors index"):
        open_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights found"):
        open_checkpoint(tmp_path)


def test_sharded_checkpoint_equals_single_file(copy_dir, tiny_dir):
    weights = load_file(copy_dir / "model.safetensors")
    (copy_dir / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(copy_dir / file))
        weight_map |= {n: file for n in part}
    (copy_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_model(copy_dir).weights
    for name, array in load_model(tiny_dir).weights.items():
        np.testing.assert_array_equal(sharded[name], array)


def test_pickle_checkpoints_are_refused(copy_dir):
    (copy_dir / "model.safetensors").rename(copy_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only pickle checkpoints found \(pytorch_model\.bin\)"):
        load_model(copy_dir)


def test_tensor_in_two_shards_is_refused(copy_dir):
    weights = load_file(copy_dir / "model.safetensors")
    save_file({"model.norm.weight": weights["model.norm.weight"]}, str(copy_dir / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"tensor model\.norm\.weight is also in"):
        load_model(copy_dir)


def test_index_with_a_non_string_shard(copy_dir):
    (copy_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 5}}))
    with pytest.raises(ValueError, match=r"index\.json: 'weight_map' must map tensor names to shard file names"):
        load_model(copy_dir)
