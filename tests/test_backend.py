"""Backend selection and dtype="auto": the checkpoint's torch_dtype decides on CUDA, float32 on the CPU;
CUDA refuses dtypes it has no kernels for. CPU-only (the CUDA branch is checked up to the point where it
would need a device)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from offline_paged.core.config import EngineConfig
from offline_paged.worker.backend import checkpoint_dtype, resolve_dtype, select_backend


@pytest.mark.parametrize("checkpoint,expected", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                                 ("float32", "float16"), ("float64", "float16"), (None, "float16")])
@pytest.mark.parametrize("dtype", ["auto", None])
def test_auto_on_cuda_follows_the_checkpoint(dtype, checkpoint, expected):
    assert resolve_dtype("cuda", dtype, checkpoint) == expected


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32", None])
def test_auto_on_the_cpu_is_float32_whatever_the_checkpoint(checkpoint):
    assert resolve_dtype("cpu", "auto", checkpoint) == "float32"
    assert select_backend("cpu", "auto", checkpoint).dtype == np.float32


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_explicit_dtype_wins_over_the_checkpoint(dtype):
    assert resolve_dtype("cuda", dtype, "float32") == dtype
    assert resolve_dtype("cpu", dtype, "bfloat16") == dtype


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_refuses_dtypes_without_kernels(dtype):
    with pytest.raises(ValueError, match=f"dtype='{dtype}' does not run on CUDA"):
        resolve_dtype("cuda", dtype)
    with pytest.raises(ValueError, match="does not run on CUDA"):  # before looking for a GPU
        select_backend("cuda", dtype)


def test_auto_refuses_a_checkpoint_dtype_it_cannot_map():
    with pytest.raises(ValueError, match=r"m/config.json: torch_dtype 'float8_e4m3fn' .*pass dtype="):
        resolve_dtype("cuda", "auto", "float8_e4m3fn", "m/config.json")


def test_checkpoint_dtype_reads_config_json(tmp_path):
    assert checkpoint_dtype(None) is None
    assert checkpoint_dtype(tmp_path / "missing") is None
    assert checkpoint_dtype(tmp_path / "model.gguf") is None
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))  # newer transformers' spelling
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "torch.float32"}))
    assert checkpoint_dtype(tmp_path) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert checkpoint_dtype(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_dtype(tmp_path) is None  # the loader reports a broken config, naming the file
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": 16}))
    with pytest.raises(ValueError, match=r"config.json: torch_dtype must be a dtype name"):
        checkpoint_dtype(tmp_path)


def test_bfloat16_on_the_cpu_is_the_ml_dtypes_type():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    backend = select_backend("cpu", "bfloat16")
    assert backend.dtype == np.dtype(ml_dtypes.bfloat16)


def test_engine_config_defaults_to_auto_and_accepts_none():
    assert EngineConfig().dtype == "auto"
    assert EngineConfig(dtype=None).dtype is None
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="half")
