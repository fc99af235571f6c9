"""FP8 weights on CUDA (cuda/fp8_linear.cu, ops/fp8_launcher.py, TunedGemm.fp8, ops/cuda_fp8_linear.py) against the
NumPy reference (ops/fp8_linear.py), in fp16 and bf16. Needs a GPU.

What is checked: the per-row quantize kernel stores exactly the reference's e4m3 bytes and float32 scales (dynamic
and static scales, odd row counts, widths that need padding, zero rows, values that saturate); a weight quantized on
the device equals Fp8Linear.quantize; the whole FP8 product (quantize -> cuBLASLt e4m3 GEMM -> scale epilogue)
equals NumPy's Fp8Linear on the same e4m3 weight within one rounding to the 16-bit dtype, at the Llama 3.2 1B and
Llama 3.1 8B layer shapes for decode (1, 7, 256 rows) and prefill (2048 rows), and at widths that need padding;
captured into a CUDA graph and replayed it equals the eager call bit for bit; `x @ layer` (the eager path) works;
misuse is refused with ValueError. The scale epilogue rounds NumPy's float32 products once, bit for bit. The quantize
and scale tests run both forms of those kernels (scalar, and 16-byte vectors where the shapes allow).
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

import offline_paged.ops.cuda_fp8_linear as cuda_fp8_linear  # noqa: E402
import offline_paged.ops.fp8_launcher as fp8_launcher  # noqa: E402
import offline_paged.ops.fp8_linear as fp8_linear  # noqa: E402
from offline_paged.ops.cublaslt import TunedGemm  # noqa: E402
from offline_paged.ops.cuda_fp8_linear import CudaFp8Linear  # noqa: E402
from offline_paged.ops.fp8_launcher import quantize_rows_fp8, scale_fp8_output  # noqa: E402
from offline_paged.ops.fp8_linear import Fp8Linear, quantize_rows, quantize_static  # noqa: E402
from offline_paged.ops.graphs import gc_paused  # noqa: E402
from offline_paged.ops.kv_scales import FP8_E4M3, quantize_fp8  # noqa: E402
from offline_paged.ops.ops_cuda import CudaOps  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
# Largest |error| / max |reference|: one rounding of the output to the dtype (2^-11 fp16, 2^-8 bf16), with room.
ROUNDING = {np.dtype(np.float16): 2e-3, BF16: 1e-2}
ACC_DTYPES = [pytest.param(np.dtype(np.float32), id="acc-fp32"), pytest.param(BF16, id="acc-bf16")]
# (in, out) of each fused linear: qkv, o_proj, gate_up, down.
LAYER_SHAPES = {"1b": [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)],
                "8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]}


def product_tolerance(dtype) -> float:
    """ROUNDING of an FP8 product of `dtype` against the NumPy reference. With fp8_linear.BF16_PRODUCTS the GEMM's
    sums are rounded to bfloat16, here and in the reference, but summed in another order: a sum near a rounding
    boundary may land one bfloat16 step away (2^-8 of it), so every output dtype then has bfloat16's room."""
    return ROUNDING[BF16] if fp8_linear.BF16_PRODUCTS else ROUNDING[np.dtype(dtype)]


def activations(rng, num_rows: int, width: int, dtype):
    """[R, K] of `dtype` with row magnitudes over three decades, one zero row, and some rows with an outlier.
    Kept within float16 and so that the products stay within it too (the first device run drew a 300x outlier
    of a 100-magnitude row: inf in float16 before any kernel ran)."""
    x = rng.standard_normal((num_rows, width)) * 10.0 ** rng.uniform(-2, 1, (num_rows, 1))
    if num_rows > 2:
        x[1] = 0.0
        x[2, rng.integers(width)] = 100.0 * np.abs(x[2]).max()
    return x.astype(dtype)


def e4m3_layer(rng, num_in: int, num_out: int) -> Fp8Linear:
    """A pre-quantized layer: random e4m3 values over e4m3's range and positive per-channel scales."""
    w = quantize_fp8((rng.standard_normal((num_out, num_in)) * 64).astype(np.float32), 1.0)  # [out, in]
    scales = (10.0 ** rng.uniform(-4, -2, num_out)).astype(np.float32)  # [out]
    return Fp8Linear.from_quantized([w], [scales])


@functools.cache
def shared_layer(num_in: int, num_out: int) -> Fp8Linear:
    """e4m3_layer of a fixed seed per shape, built once per session (the 8B ones take seconds)."""
    return e4m3_layer(np.random.default_rng(num_in * 31 + num_out), num_in, num_out)


@pytest.fixture(params=[True, False], ids=["scales-in-cublaslt", "scale-kernel"])
def scales_in_cublaslt(request, monkeypatch):
    """Both ways of applying the scales (cuda_fp8_linear.SCALES_IN_CUBLASLT); the first falls back to the second
    where cuBLASLt has no outer-vector algorithm."""
    monkeypatch.setattr(cuda_fp8_linear, "SCALES_IN_CUBLASLT", request.param)
    return request.param


@pytest.fixture(params=[False, True], ids=["scalar-kernels", "vector-kernels"])
def vector_kernels(request, monkeypatch):
    """Both forms of the quantize and scale kernels (fp8_launcher.VECTOR_KERNELS): the same bytes either way; the
    vector form falls back to the scalar one where a width or an address does not allow it."""
    monkeypatch.setattr(fp8_launcher, "VECTOR_KERNELS", request.param)
    return request.param


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all(), "output has NaN/inf"
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, width", [(1, 64), (7, 2048), (33, 4096), (5, 100), (3, 40), (300, 14336)])
def test_quantize_kernel_stores_the_reference_bytes(num_rows, width, dtype, vector_kernels):
    rng = np.random.default_rng(num_rows * 7 + width)
    x = activations(rng, num_rows, width, dtype)
    xq, scales = quantize_rows_fp8(cupy.asarray(x))
    want_q, want_scales = quantize_rows(x.astype(np.float32))
    assert xq.shape == (num_rows, -(-width // 16) * 16)
    np.testing.assert_array_equal(xq.get()[:, :width], want_q.view(np.uint8))
    assert not xq.get()[:, width:].any()  # the padding of the inner dimension is zeros
    np.testing.assert_array_equal(scales.get(), want_scales)
    if num_rows > 2:
        assert scales.get()[1] == 1.0 and (xq.get()[2] == 0x7E).sum() >= 1  # zero row; the outlier stores 448


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_scale_quantizes_as_quantize_static(dtype, vector_kernels):
    """A checkpoint's input_scale: every row divided by it, values beyond 448 x scale saturate."""
    rng = np.random.default_rng(11)
    x = activations(rng, 9, 96, dtype)
    xq, scales = quantize_rows_fp8(cupy.asarray(x), static_scale=0.05)
    want_q, want_scales = quantize_static(x.astype(np.float32), 0.05)
    np.testing.assert_array_equal(xq.get(), want_q.view(np.uint8))
    np.testing.assert_array_equal(scales.get(), want_scales)


@pytest.mark.parametrize("acc_dtype", ACC_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, num_out, padded_out", [(1, 64, 64), (7, 6144, 6144), (256, 28672, 28672),
                                                           (5, 50, 64), (3, 132, 144)])
def test_scale_kernel_rounds_the_reference_products_once(num_rows, num_out, padded_out, dtype, acc_dtype,
                                                         vector_kernels):
    """(acc x x_scale) x w_scale in float32, rounded once to the dtype: bit for bit NumPy's float32 products, from
    a float32 or a bfloat16 accumulator."""
    rng = np.random.default_rng(num_out)
    acc = (rng.standard_normal((num_rows, padded_out)) * 1e4).astype(acc_dtype).astype(np.float32)  # [R, Np]
    x_scale = (10.0 ** rng.uniform(-4, -1, num_rows)).astype(np.float32)  # [R]
    w_scale = (10.0 ** rng.uniform(-4, -2, padded_out)).astype(np.float32)  # [Np]
    out = scale_fp8_output(cupy.asarray(acc.astype(acc_dtype)), cupy.asarray(x_scale), cupy.asarray(w_scale),
                           num_out, dtype)
    want = ((acc[:, :num_out] * x_scale[:, None]) * w_scale[None, :num_out]).astype(dtype)  # [R, N]
    assert out.dtype == dtype and out.shape == (num_rows, num_out)
    np.testing.assert_array_equal(out.get().view(np.uint16), want.view(np.uint16))


def test_vector_kernels_run_where_widths_and_addresses_allow(monkeypatch):
    """With VECTOR_KERNELS on, K % 8 == 0 and N % 4 == 0 take the vector kernels, other widths the scalar ones."""
    launched = []
    original = fp8_launcher._kernel
    monkeypatch.setattr(fp8_launcher, "_kernel", lambda source, name: launched.append(name) or original(source, name))
    monkeypatch.setattr(fp8_launcher, "VECTOR_KERNELS", True)
    rng = np.random.default_rng(8)
    acc, w_scale = cupy.ones((4, 64), dtype=cupy.float32), cupy.ones(64, dtype=cupy.float32)
    _, x_scale = quantize_rows_fp8(cupy.asarray(activations(rng, 4, 4096, np.float16)))
    scale_fp8_output(acc, x_scale, w_scale, 64, np.float16)
    quantize_rows_fp8(cupy.asarray(activations(rng, 4, 100, np.float16)))  # K % 8 != 0
    scale_fp8_output(acc, x_scale, w_scale, 62, np.float16)  # N % 4 != 0
    scale_fp8_output(acc.astype(BF16), x_scale, w_scale, 64, np.float16)
    scale_fp8_output(acc.astype(BF16), x_scale, w_scale, 62, BF16)
    assert launched == ["quantize_rows_fp8_vec_f16", "scale_fp8_output_vec_f16", "quantize_rows_fp8_f16",
                        "scale_fp8_output_f16", "scale_fp8_output_vec_bf16acc_f16", "scale_fp8_output_bf16acc_bf16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_quantized_on_the_device_equals_fp8_linear_quantize(dtype, vector_kernels):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((200, 136)) * 10.0 ** rng.uniform(-3, 0, (200, 1))).astype(dtype)  # [out, in]
    w[3] = 0.0
    layer = CudaFp8Linear.quantize(cupy.asarray(w))
    want = Fp8Linear.quantize(w.astype(np.float32).T)
    assert layer.shape == want.shape == (136, 200) and layer.weight.shape == (208, 144)
    np.testing.assert_array_equal(layer.weight.get()[:200, :136], want.weight.view(np.uint8).T)
    np.testing.assert_array_equal(layer.weight_scale.get()[:200], want.weight_scale)
    assert not layer.weight.get()[200:].any() and not layer.weight.get()[:, 136:].any()
    np.testing.assert_allclose(layer.dequantized().get(), want.dequantized(), rtol=0, atol=0)


@pytest.mark.parametrize("num_rows", [1, 7, 256, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", list(LAYER_SHAPES))
def test_fp8_product_equals_numpy_fp8_linear_at_llama_shapes(model, dtype, num_rows, scales_in_cublaslt,
                                                            vector_kernels):
    """Our kernels around the GEMM against NumPy, the GEMM's sums promoted to float32 (fast accumulation's own
    error, ~1% of the largest output at K = 14336 and 2,048 rows, is bounded in its test below)."""
    rng = np.random.default_rng(num_rows)
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = TunedGemm(stream, fp8_fast_accum=False)
    for num_in, num_out in LAYER_SHAPES[model]:
        host = shared_layer(num_in, num_out)
        x = activations(rng, num_rows, num_in, dtype)
        with stream:
            out = gemm(cupy.asarray(x), CudaFp8Linear.upload(host))
            stream.synchronize()
        assert out.dtype == dtype and out.shape == (num_rows, num_out)
        error = rel_error(out.get(), x.astype(np.float32) @ host)
        assert error < product_tolerance(dtype), f"[{num_rows}, {num_in}] @ [{num_in}, {num_out}]: {error:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_in, num_out", [(100, 50), (576, 960), (24, 8)])
def test_fp8_product_pads_widths_that_are_not_multiples_of_16(num_in, num_out, dtype, scales_in_cublaslt):
    rng = np.random.default_rng(num_in)
    host = e4m3_layer(rng, num_in, num_out)
    x = activations(rng, 13, num_in, dtype)
    out = cupy.asarray(x) @ CudaFp8Linear.upload(host, CudaOps().fp8_gemm)
    assert out.shape == (13, num_out)
    assert rel_error(out.get(), x.astype(np.float32) @ host) < product_tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_matmul_operator_runs_the_fp8_product(dtype):
    """`x @ layer` on a cupy x (the model's eager matmul) reaches CudaFp8Linear.__rmatmul__ and CudaOps' GEMM of
    the current stream; it equals NumPy's Fp8Linear of the same weight."""
    rng = np.random.default_rng(2)
    ops = CudaOps()
    w = rng.standard_normal((384, 512)).astype(dtype)  # [out, in]
    layer = ops.quantize_linear(cupy.asarray(w))
    x = activations(rng, 19, 512, dtype)
    out = cupy.asarray(x) @ layer
    assert out.dtype == dtype and out.shape == (19, 384)
    want = x.astype(np.float32) @ Fp8Linear.quantize(w.astype(np.float32).T)
    assert rel_error(out.get(), want) < product_tolerance(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        again = cupy.asarray(x) @ layer
        stream.synchronize()
    assert ops.fp8_gemm() is not ops._fp8_gemms[stream.ptr]  # one GEMM per stream
    np.testing.assert_array_equal(again.get(), out.get())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-input-scale"])
def test_fp8_product_captured_in_a_graph_equals_the_eager_call(dtype, static, scales_in_cublaslt, vector_kernels):
    """A decode graph's TunedGemm: the product captured once (tuned first, eagerly), replayed on new inputs at the
    same address, is bit for bit the eager product of those inputs."""
    rng = np.random.default_rng(4)
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = TunedGemm(stream)
    host = e4m3_layer(rng, 1024, 3072)
    if static:
        host = Fp8Linear(host.weight, host.weight_scale, host.weight.astype(np.float32), input_scale=0.02)
    layer = CudaFp8Linear.upload(host)
    x = cupy.asarray(activations(rng, 64, 1024, dtype))
    with stream:
        gemm(x, layer)  # tunes the shape outside the capture
        stream.synchronize()
        with gc_paused():
            stream.begin_capture()
            captured = gemm(x, layer)  # [64, 3072], written by the replay
            graph = stream.end_capture()
    x[...] = cupy.asarray(activations(rng, 64, 1024, dtype))
    cupy.cuda.Device().synchronize()
    graph.launch(stream)
    with stream:
        eager = gemm(x, layer)
        stream.synchronize()
    np.testing.assert_array_equal(captured.get(), eager.get())
    want = (x.get().astype(np.float32) @ host).astype(np.float64)
    assert rel_error(eager.get(), want) < product_tolerance(dtype)


@pytest.mark.parametrize("num_rows, num_in, num_out", [(256, 4096, 28672), (7, 2048, 3072), (1, 8192, 2048)])
def test_the_gemm_writes_its_float32_sums_rounded_to_bfloat16(num_rows, num_in, num_out):
    """TunedGemm.fp8 into a bfloat16 acc (fp8_linear.BF16_PRODUCTS) holds the float32 acc's sums rounded once: equal
    where both GEMMs summed alike, else one bfloat16 step apart; never further. Sums promoted to float32: with fast
    accumulation the two GEMMs (each its own algorithm) differ by more than the rounding (a device run saw it)."""
    rng = np.random.default_rng(num_out)
    host = shared_layer(num_in, num_out)
    layer = CudaFp8Linear.upload(host)
    xq, _ = quantize_rows_fp8(cupy.asarray(activations(rng, num_rows, num_in, BF16)))
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = TunedGemm(stream, fp8_fast_accum=False)
    with stream:
        wide = gemm.fp8(xq, layer.weight, cupy.empty((num_rows, layer.weight.shape[0]), np.float32)).get()
        narrow = gemm.fp8(xq, layer.weight, cupy.empty((num_rows, layer.weight.shape[0]), BF16)).get()
    rounded = wide.astype(BF16)
    steps = np.abs(narrow.view(np.int16).astype(np.int32) - rounded.view(np.int16).astype(np.int32))
    assert steps.max() <= 1, f"{int((steps > 1).sum())} sums more than one bfloat16 step from float32's"
    assert (steps == 0).mean() > 0.99
    assert np.abs(narrow.astype(np.float32)).max() > 1e3  # real sums, not zeros


# Largest |sum - exact| / sum_k |x_k w_k| of an FP8 GEMM's float32 sums: promoted to float32 every few k-steps
# (the default), and in the tensor cores' own accumulator for the whole inner dimension (fp8_fast_accum).
PROMOTED_ERROR, FAST_ACCUM_ERROR = 2.0**-11, 2.0**-7


@pytest.mark.parametrize("num_in, num_out", [(4096, 6144), (14336, 4096)])
def test_fast_accumulation_moves_the_sums_but_keeps_them_near_exact(num_in, num_out):
    """TunedGemm(fp8_fast_accum=True) against the default GEMM and an exact float64 product of the same e4m3 values:
    the flag reaches cuBLASLt (sums differ from the promoted ones), and each sum stays within FAST_ACCUM_ERROR of
    the entry's sum of |terms| (the scale of what was added; the promoted ones within PROMOTED_ERROR)."""
    rng = np.random.default_rng(num_in)
    layer = CudaFp8Linear.upload(shared_layer(num_in, num_out))
    xq, _ = quantize_rows_fp8(cupy.asarray(activations(rng, 64, num_in, BF16)))
    sums = {}
    for fast in (False, True):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            acc = cupy.empty((64, layer.weight.shape[0]), np.float32)
            sums[fast] = TunedGemm(stream, fp8_fast_accum=fast).fp8(xq, layer.weight, acc).get().astype(np.float64)
    x = xq.get().view(FP8_E4M3).astype(np.float64)  # [64, K]
    w = layer.weight.get().view(FP8_E4M3).astype(np.float64)  # [N, K]
    exact, terms = x @ w.T, np.abs(x) @ np.abs(w).T
    scale = np.maximum(terms, 1.0)  # the zero row's entries: exact 0, terms 0
    promoted, fast = np.abs(sums[False] - exact) / scale, np.abs(sums[True] - exact) / scale
    assert promoted.max() <= PROMOTED_ERROR, f"promoted sums {promoted.max():.2e} of sum|terms| from exact"
    assert fast.max() <= FAST_ACCUM_ERROR, f"fast-accumulated sums {fast.max():.2e} of sum|terms| from exact"
    assert (sums[True] != sums[False]).mean() > 0.01, "fast accumulation changed no sum: the flag did not reach it"
    assert np.abs(exact).max() > 1e3  # real sums, not zeros


@pytest.mark.parametrize("dtype", DTYPES)
def test_cublaslt_outer_vector_scales(dtype):
    """TunedGemm.fp8_scaled on this device: cuBLASLt applies x_scale per token and w_scale per channel and writes the
    16-bit output (equal to the scale kernel's path within one rounding), or it says False and launches nothing."""
    rng = np.random.default_rng(9)
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = TunedGemm(stream)
    host = shared_layer(4096, 6144)
    layer = CudaFp8Linear.upload(host)
    x = activations(rng, 256, 4096, dtype)
    with stream:
        xq, x_scale = quantize_rows_fp8(cupy.asarray(x))
        out = cupy.full((256, 6144), np.nan, dtype=dtype)
        supported = gemm.fp8_scaled(xq, layer.weight, x_scale, layer.weight_scale, out)
        stream.synchronize()
    print(f"\ncuBLASLt outer-vector FP8 scales ({dtype.name}): {'supported' if supported else 'not supported'}")
    if not supported:
        assert np.isnan(out.get().astype(np.float32)).all()  # nothing was written
        pytest.skip("cuBLASLt has no outer-vector FP8 algorithm here: the scale kernel's path runs")
    assert rel_error(out.get(), x.astype(np.float32) @ host) < product_tolerance(dtype)


def test_misuse_is_refused_with_value_errors():
    x16 = cupy.zeros((4, 32), dtype=np.float16)
    layer = CudaFp8Linear.upload(e4m3_layer(np.random.default_rng(0), 32, 16))
    gemm = TunedGemm(cupy.cuda.Stream(non_blocking=True))
    with pytest.raises(ValueError, match="must be float16 or bfloat16"):
        quantize_rows_fp8(cupy.zeros((4, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="padded_width must be a multiple of 16"):
        quantize_rows_fp8(x16, padded_width=40)
    with pytest.raises(ValueError, match="static_scale must be a positive finite number"):
        quantize_rows_fp8(x16, static_scale=0.0)
    with pytest.raises(ValueError, match="inner and output widths padded to multiples of 16"):
        gemm.fp8(cupy.zeros((4, 24), np.uint8), cupy.zeros((16, 24), np.uint8), cupy.zeros((4, 16), np.float32))
    with pytest.raises(ValueError, match="cannot be written to acc"):
        gemm.fp8(cupy.zeros((4, 32), np.uint8), cupy.zeros((16, 32), np.uint8), cupy.zeros((4, 32), np.float32))
    with pytest.raises(ValueError, match="acc must be float32 or bfloat16"):
        gemm.fp8(cupy.zeros((4, 32), np.uint8), cupy.zeros((16, 32), np.uint8), cupy.zeros((4, 16), np.float16))
    with pytest.raises(ValueError, match=r"x_scale must be a contiguous float32 cupy.ndarray of shape \(4,\)"):
        gemm.fp8_scaled(cupy.zeros((4, 32), np.uint8), layer.weight, cupy.ones(3, np.float32), layer.weight_scale,
                        cupy.zeros((4, 16), np.float16))
    with pytest.raises(ValueError, match="fp8_scaled writes float16 or bfloat16"):
        gemm.fp8_scaled(cupy.zeros((4, 32), np.uint8), layer.weight, cupy.ones(4, np.float32), layer.weight_scale,
                        cupy.zeros((4, 16), np.float32))
    with pytest.raises(ValueError, match="out_dtype and out must be None"):
        gemm(x16, layer, out_dtype=np.float32)
    with pytest.raises(ValueError, match="cannot multiply x of shape"):
        layer.apply(cupy.zeros((4, 48), dtype=np.float16), gemm)
    with pytest.raises(ValueError, match="acc must be float32"):
        scale_fp8_output(cupy.zeros((4, 16), np.float16), cupy.ones(4, np.float32), cupy.ones(16, np.float32), 16,
                         np.float16)
    host = e4m3_layer(np.random.default_rng(1), 32, 16)
    with pytest.raises(ValueError, match="static input_scale must be a positive finite number"):
        CudaFp8Linear.upload(Fp8Linear(host.weight, host.weight_scale, host.weight.astype(np.float32), 0.0))
    with pytest.raises(RuntimeError, match="has no GEMM"):
        x16 @ layer
    assert FP8_E4M3.itemsize == 1
