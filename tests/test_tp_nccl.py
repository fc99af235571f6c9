"""The CPU-checkable parts of the NCCL communicator (tp/tp_nccl.py): NVLink multicast forced off, bad
ranks refused before CuPy is touched, and the buffer checks with their NCCL type codes. The collectives
themselves run on GPUs in test_tensor_parallel_gpu.py."""
from __future__ import annotations

import os

import numpy as np
import pytest

from offline_paged.tp import tp_nccl
from offline_paged.tp.tp_nccl import NcclCommunicator, disable_nvls


def test_disable_nvls_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    disable_nvls()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("rank, world_size", [(-1, 2), (2, 2), (0, 0)])
def test_a_bad_rank_is_refused_before_cupy_is_imported(rank, world_size):
    with pytest.raises(ValueError, match="rank must be in"):
        NcclCommunicator(None, rank, world_size)


def _unconnected() -> NcclCommunicator:
    return object.__new__(NcclCommunicator)  # no NCCL group: only the buffer checks are used


@pytest.mark.parametrize("dtype, code", [(np.int32, 2), (np.float16, 6), (np.float32, 7), (np.float64, 8)])
def test_buffer_check_returns_the_nccl_type_code(dtype, code):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(dtype)
    assert _unconnected()._check(x, "all_reduce") == code


def test_bfloat16_is_nccl_type_9():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(1).standard_normal(5).astype(ml_dtypes.bfloat16)
    assert _unconnected()._check(x, "broadcast") == 9 == tp_nccl._NCCL_TYPES["bfloat16"]


def test_buffer_check_refuses_other_dtypes_and_strided_buffers():
    comm = _unconnected()
    with pytest.raises(ValueError, match=r"NcclCommunicator.all_gather: dtype int64 is not one of"):
        comm._check(np.arange(4, dtype=np.int64), "all_gather")
    x = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    with pytest.raises(ValueError, match=r"all_reduce: the buffer must be C-contiguous \(shape \(4, 3\)\)"):
        comm._check(x[:, ::2], "all_reduce")
