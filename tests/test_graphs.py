"""The capture-safe cuBLAS GEMM (ops/graphs.py) against a float64 product, eagerly and replayed from a
CUDA graph, with C- and F-contiguous weights, in fp16 and bf16; mixed or unsupported dtypes refused.
Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import ml_dtypes  # noqa: E402  (bf16 arrays; a GPU run without it must fail, not skip)
pytestmark = pytest.mark.gpu

from offline_paged.ops.graphs import CublasGemm  # noqa: E402


BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
# One rounding of an O(1)-relative result to the dtype (half an ulp: 2^-11 fp16, 2^-8 bf16), with room.
ROUNDING = {np.dtype(np.float16): 2e-3, BF16: 1e-2}


def rel_error(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def host_matmul(x, w) -> np.ndarray:
    """float64 product of the device operands' exact values (the truth a GEMM rounds once)."""
    return x.get().astype(np.float64) @ w.get().astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_gemm_matches_float64_eagerly_and_replayed(num_rows, dtype):
    rng = np.random.default_rng(num_rows)
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = CublasGemm(stream)
    w_c = cupy.asarray(rng.standard_normal((576, 1000)).astype(dtype))  # [K, N] C-contiguous
    w_f = cupy.asarray(rng.standard_normal((1000, 576)).astype(dtype)).T  # [K, N] F-contiguous (tied head)
    x = cupy.asarray(rng.standard_normal((num_rows, 576)).astype(dtype))  # [T, K]
    with stream:
        for w in (w_c, w_f):
            out = gemm(x, w)
            assert out.dtype == dtype
            assert rel_error(out.get(), host_matmul(x, w)) < ROUNDING[dtype]
        stream.synchronize()
        stream.begin_capture()
        outs = [gemm(x, w) for w in (w_c, w_f)]  # [T, N] each, written only by the replay
        graph = stream.end_capture()
    x[...] = cupy.asarray(rng.standard_normal((num_rows, 576)).astype(dtype))  # new inputs, same address
    cupy.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    for out, w in zip(outs, (w_c, w_f)):
        assert rel_error(out.get(), host_matmul(x, w)) < ROUNDING[dtype]


def test_gemm_refuses_mixed_or_unsupported_dtypes():
    gemm = CublasGemm(cupy.cuda.Stream(non_blocking=True))
    x16, xb = cupy.ones((2, 8), cupy.float16), cupy.ones((2, 8), BF16)
    with pytest.raises(ValueError, match="x is bfloat16 but w is float16"):
        gemm(xb, x16.T.copy())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gemm(cupy.ones((2, 8), cupy.float32), cupy.ones((8, 2), cupy.float32))
    with pytest.raises(ValueError, match="out_dtype must be bfloat16"):
        gemm(xb, cupy.ones((8, 2), BF16), out_dtype=np.float16)
