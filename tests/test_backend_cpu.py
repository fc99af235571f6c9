"""worker.backend on the CPU: device and dtype selection, and the host helpers (dtype="auto" and the
CUDA rules live in test_backend.py)."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.ops.ops_numpy import NumpyOps
from offline_paged.worker.backend import cuda_available, select_backend


def test_cpu_backend_is_numpy_float32_by_default():
    backend = select_backend("cpu")
    assert backend.name == "cpu" and backend.xp is np and isinstance(backend.ops, NumpyOps)
    assert backend.dtype == np.float32
    assert backend.free_memory_bytes() is None


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_cpu_backend_takes_a_dtype(dtype):
    assert select_backend("cpu", dtype).dtype == np.dtype(dtype)


def test_bfloat16_comes_from_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert select_backend("cpu", "bfloat16").dtype == np.dtype(ml_dtypes.bfloat16)


def test_host_helpers_convert_without_copying_semantics():
    backend = select_backend("cpu")
    values = np.random.default_rng(0).integers(-5, 5, 7)
    assert backend.int32(values.tolist()).dtype == np.int32
    assert backend.int32(values).tolist() == values.tolist()
    array = np.random.default_rng(1).standard_normal(3)
    assert backend.to_host(array) is not None and np.array_equal(backend.to_host(array), array)


@pytest.mark.parametrize("device, dtype, message", [
    ("tpu", None, "device must be 'auto', 'cpu' or 'cuda', got 'tpu'"),
    ("cpu", "float8", "unknown dtype 'float8'"),
])
def test_bad_device_or_dtype_is_named(device, dtype, message):
    with pytest.raises(ValueError, match=message):
        select_backend(device, dtype)


def test_auto_picks_what_is_there():
    assert select_backend("auto").name == ("cuda" if cuda_available() else "cpu")


@pytest.mark.skipif(cuda_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu_says_how_to_get_one():
    with pytest.raises(ValueError, match=r"device='cuda' needs CuPy .*offline-paged\[cuda\]"):
        select_backend("cuda")


@pytest.mark.parametrize("name", ["ndarray", "int32", "uint8", "bool_", "complex64", "half"])
def test_a_name_that_is_no_model_dtype_is_refused(name):
    with pytest.raises(ValueError, match=f"unknown dtype '{name}'"):
        select_backend("cpu", name)
