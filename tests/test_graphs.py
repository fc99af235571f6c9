"""The capture-safe cuBLAS GEMMs (ops/graphs.py CublasGemm, ops/cublaslt.py TunedGemm) against a float64
product, eagerly and replayed from a CUDA graph, with C- and F-contiguous weights, in fp16 and bf16, fp32
output; mixed or unsupported dtypes refused; TunedGemm's timed choice and its untimed first capture.
Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
import ml_dtypes  # noqa: E402  (bf16 arrays; a GPU run without it must fail, not skip)
pytestmark = pytest.mark.gpu

from offline_paged.ops.cublaslt import TunedGemm  # noqa: E402
from offline_paged.ops.graphs import CublasGemm, gc_paused  # noqa: E402


BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
# One rounding of an O(1)-relative result to the dtype (half an ulp: 2^-11 fp16, 2^-8 bf16), with room.
ROUNDING = {np.dtype(np.float16): 2e-3, BF16: 1e-2}
GEMMS = [pytest.param(CublasGemm, id="gemmEx"), pytest.param(TunedGemm, id="lt_tuned")]


def rel_error(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def host_matmul(x, w) -> np.ndarray:
    """float64 product of the device operands' exact values (the truth a GEMM rounds once)."""
    return x.get().astype(np.float64) @ w.get().astype(np.float64)


@pytest.mark.parametrize("gemm_class", GEMMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_gemm_matches_float64_eagerly_and_replayed(num_rows, dtype, gemm_class):
    rng = np.random.default_rng(num_rows)
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = gemm_class(stream)
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_tuned_gemm_keeps_the_fastest_candidate_and_writes_fp32(dtype):
    """The first eager call of a shape times every candidate and keeps the fastest; the fp32 output (the
    LM head's logits) is the fp32 accumulator, closer to float64 than one rounding to the dtype."""
    rng = np.random.default_rng(7)
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = TunedGemm(stream)
    x = cupy.asarray(rng.standard_normal((256, 2048)).astype(dtype))  # [T, K]
    w = cupy.asarray(rng.standard_normal((2048, 1024)).astype(dtype))  # [K, N]
    with stream:
        out = gemm(x, w, out_dtype=np.float32)
        stream.synchronize()
    (plan,) = gemm.plans.values()
    assert len(plan.algos) >= 1 and len(plan.times_ms) == len(plan.algos)
    assert all(t > 0 for t in plan.times_ms)
    assert plan.times_ms[plan.chosen] == min(plan.times_ms)
    assert out.dtype == np.float32
    assert rel_error(out.get(), host_matmul(x, w)) < 1e-5


def test_tuned_gemm_first_seen_inside_a_capture_takes_the_first_candidate():
    rng = np.random.default_rng(8)
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = TunedGemm(stream)
    x = cupy.asarray(rng.standard_normal((32, 512)).astype(np.float16))  # [T, K]
    w = cupy.asarray(rng.standard_normal((512, 768)).astype(np.float16))  # [K, N]
    out = cupy.empty((32, 768), dtype=np.float16)  # [T, N], written by the replay (no allocation in the capture)
    with stream, gc_paused():
        stream.begin_capture()
        gemm(x, w, out=out)
        graph = stream.end_capture()
    (plan,) = gemm.plans.values()
    assert plan.chosen == 0 and plan.times_ms == []
    graph.launch(stream)
    stream.synchronize()
    assert rel_error(out.get(), host_matmul(x, w)) < ROUNDING[np.dtype(np.float16)]


@pytest.mark.parametrize("gemm_class", GEMMS)
def test_gemm_refuses_mixed_or_unsupported_dtypes(gemm_class):
    gemm = gemm_class(cupy.cuda.Stream(non_blocking=True))
    x16, xb = cupy.ones((2, 8), cupy.float16), cupy.ones((2, 8), BF16)
    with pytest.raises(ValueError, match="x is bfloat16 but w is float16"):
        gemm(xb, x16.T.copy())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gemm(cupy.ones((2, 8), cupy.float32), cupy.ones((8, 2), cupy.float32))
    with pytest.raises(ValueError, match="out_dtype must be bfloat16"):
        gemm(xb, cupy.ones((8, 2), BF16), out_dtype=np.float16)
