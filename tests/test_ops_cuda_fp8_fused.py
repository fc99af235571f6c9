"""An FP8 layer's input quantized by the kernel that makes it (layer.cu's rms_norm_fp8 / silu_mul_fp8, CudaOps'
`feeds`): byte for byte the 16-bit kernel followed by fp8_launcher.quantize_rows_fp8, which
tests/test_ops_cuda_fp8_linear.py checks against the NumPy reference. Needs a GPU.

What is checked, in fp16 and bf16: the e4m3 bytes, the float32 row scales and (rms_norm) the new residual equal the
two-launch path's, with and without a residual, with a static input scale, on the vector path (widths of 8k, with
padding to 16, and rows longer than the registers hold) and the scalar one (odd widths, a misaligned array); a zero
row; CudaOps hands an FP8 layer Fp8Rows that give the same product as its 16-bit rows, eagerly and replayed from a
CUDA graph; rows made for another layer are refused. The product-reading forms (rms_norm_fp8_product,
silu_mul_fp8_product: an FP8 GEMM's product, float32 or bfloat16, read before its scale epilogue) equal
scale_fp8_output followed by the 16-bit-input form, and CudaOps.deferred layers hand them Fp8Product with the same
final bytes; rope_write_kv_product (the qkv projection's product read by rope_write_kv) equals scale_fp8_output then
rope_write_kv into 16-bit and FP8 caches, and CudaOps.qkv_rope_write_kv takes it or falls back. fp8.cuh's
Fp8Divisor, which every FP8 write divides through, quantizes as __fdiv_rn does on every 16-bit value over scales
across its range. The vector e4m3 rounding every vector FP8 write goes through (fp8.cuh's float8_to_e4m3x8: the
hardware cvt on sm_89+) equals ml_dtypes' on every fp16 and bf16 value, ties and saturation edges, and keeps a NaN's
sign.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

import offline_paged.ops.cuda_fp8_linear as cuda_fp8_linear  # noqa: E402
from offline_paged.ops import launchers  # noqa: E402
from offline_paged.ops.cublaslt import TunedGemm  # noqa: E402
from offline_paged.ops.cuda_fp8_linear import CudaFp8Linear, Fp8Product, Fp8Rows  # noqa: E402
from offline_paged.ops.fp8_launcher import quantize_rows_fp8, scale_fp8_output  # noqa: E402
from offline_paged.ops.graphs import gc_paused  # noqa: E402
from offline_paged.ops.kernel_modules import inline_headers  # noqa: E402
from offline_paged.ops.ops_cuda import CudaOps  # noqa: E402
from offline_paged.ops.attention import split_qkv  # noqa: E402
from test_fp8_conversions import E4M3, _inputs  # noqa: E402
from test_launchers import rope_write_kv_case  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
ACC_DTYPES = [pytest.param(np.dtype(np.float32), id="acc-fp32"), pytest.param(BF16, id="acc-bf16")]
# (rows, width): decode and prefill rows at Llama widths (vector path), widths padded to 16 (40, 36: the second
# takes the scalar path), and rows longer than the 4 x 1024 chunks of 8 a block keeps in registers; with more rows
# than SMs, the rule of launchers.fp8_input_threads takes blocks of at most 512 threads, so rows past 4 x 512 chunks
# (the rule is the default, FP8_INPUT_CHUNKS_PER_THREAD = None; these shapes ran under it on the H200 at 59b3bd6).
SHAPES = [(1, 2048), (7, 4096), (256, 4096), (5, 40), (3, 36), (2, 33_024), (140, 17_408)]
SILU_SHAPES = [(1, 8192), (7, 14_336), (256, 14_336), (5, 40), (3, 36), (2, 33_000), (140, 16_800)]


def rows(rng, num_rows: int, width: int, dtype):
    """[R, K] of `dtype`, row magnitudes over three decades, row 1 zero (when there is one)."""
    x = rng.standard_normal((num_rows, width)) * 10.0 ** rng.uniform(-2, 1, (num_rows, 1))
    if num_rows > 1:
        x[1] = 0.0
    return cupy.asarray(x.astype(dtype))


def misaligned(a):
    """A C-contiguous copy of `a` whose data starts 2 bytes past a 16-byte boundary (the kernels' scalar path)."""
    flat = cupy.empty(a.size + 1, dtype=a.dtype)[1:]
    flat[...] = a.reshape(-1)
    assert flat.data.ptr % 16 == 2
    return flat.reshape(a.shape)


def assert_same_fp8_rows(xq, scales, want_xq, want_scales):
    assert xq.dtype == np.uint8 and xq.shape == want_xq.shape
    np.testing.assert_array_equal(scales.get(), want_scales.get())
    np.testing.assert_array_equal(xq.get(), want_xq.get())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, hidden", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
def test_rms_norm_fp8_stores_the_bytes_of_rms_norm_then_quantize(num_rows, hidden, with_residual, dtype):
    rng = np.random.default_rng(num_rows * 13 + hidden)
    x = rows(rng, num_rows, hidden, dtype)
    residual = None
    if with_residual:
        residual = rows(rng, num_rows, hidden, dtype)
        if num_rows > 1:
            residual[1] = 0  # keeps the zero row zero: its scale is 1
    weight = cupy.asarray((1 + 0.5 * rng.standard_normal(hidden)).astype(dtype))
    normed, want_residual = launchers.rms_norm(x, weight, 1e-5, residual)
    want_xq, want_scales = quantize_rows_fp8(normed)
    xq, scales, residual_out = launchers.rms_norm_fp8(x, weight, 1e-5, residual)
    assert_same_fp8_rows(xq, scales, want_xq, want_scales)
    np.testing.assert_array_equal(residual_out.get().view(np.uint16), want_residual.get().view(np.uint16))
    if num_rows > 1:  # the zero row: scale 1, zeros (-0 where a weight is negative)
        assert scales.get()[1] == 1.0 and not (xq.get()[1] & 0x7F).any()
    assert np.abs(xq.get()[:, :hidden].view(ml_dtypes.float8_e4m3fn).astype(np.float32)).max() == 448.0


def test_fp8_input_threads_fit_two_blocks_an_sm_when_the_rows_outnumber_the_sms(monkeypatch):
    sms = launchers._num_sms()
    monkeypatch.setattr(launchers, "FP8_INPUT_CHUNKS_PER_THREAD", None)  # the rule
    assert launchers.fp8_input_threads(1792, sms + 1, sms) == 512  # 8B silu_mul, 256 rows: ~3.5 chunks a thread
    assert launchers.fp8_input_threads(1792, sms, sms) == 1024  # fewer rows: spread wide
    assert launchers.fp8_input_threads(256, 256, sms) == 256  # 1B rms_norm: one chunk a thread
    assert launchers.fp8_input_threads(40, 256, sms) == 64  # the scalar path's elements, rounded up to a warp
    assert launchers.fp8_input_threads(2176, 256, sms, sums=True) == 1024  # rms_norm_fp8: rms_norm's threads
    monkeypatch.setattr(launchers, "FP8_INPUT_CHUNKS_PER_THREAD", 4)  # forced
    assert launchers.fp8_input_threads(1792, 8, sms) == 448


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fp8_static_scale_wider_padding_and_scalar_path(dtype):
    """A checkpoint's input_scale for every row; padding beyond the next multiple of 16 (a layer's Kp); a
    misaligned x (the scalar path of a width the vector path would take)."""
    rng = np.random.default_rng(5)
    x, residual = rows(rng, 9, 256, dtype), rows(rng, 9, 256, dtype)
    weight = cupy.asarray((1 + 0.5 * rng.standard_normal(256)).astype(dtype))
    normed, want_residual = launchers.rms_norm(x, weight, 1e-6, residual)
    for static_scale, padded_width in [(0.004, 256), (None, 288)]:
        want_xq, want_scales = quantize_rows_fp8(normed, padded_width, static_scale)
        for x_in in (x, misaligned(x)):
            xq, scales, residual_out = launchers.rms_norm_fp8(x_in, weight, 1e-6, residual, padded_width,
                                                              static_scale)
            assert_same_fp8_rows(xq, scales, want_xq, want_scales)
            np.testing.assert_array_equal(residual_out.get().view(np.uint16), want_residual.get().view(np.uint16))
    assert (np.delete(scales.get(), 1) != 1.0).all()  # (row 1 is zero in x and residual: scale 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, inter", SILU_SHAPES)
def test_silu_mul_fp8_stores_the_bytes_of_silu_mul_then_quantize(num_rows, inter, dtype):
    rng = np.random.default_rng(num_rows * 17 + inter)
    gate_up = rows(rng, num_rows, 2 * inter, dtype)
    want_xq, want_scales = quantize_rows_fp8(launchers.silu_mul(gate_up))
    xq, scales = launchers.silu_mul_fp8(gate_up)
    assert_same_fp8_rows(xq, scales, want_xq, want_scales)
    if num_rows > 1:
        assert scales.get()[1] == 1.0 and not (xq.get()[1] & 0x7F).any()  # silu(0) * 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_fp8_static_scale_wider_padding_and_scalar_path(dtype):
    rng = np.random.default_rng(6)
    gate_up = rows(rng, 11, 2 * 1024, dtype)
    out = launchers.silu_mul(gate_up)
    for static_scale, padded_width in [(0.01, 1024), (None, 1056)]:
        want_xq, want_scales = quantize_rows_fp8(out, padded_width, static_scale)
        for g in (gate_up, misaligned(gate_up)):
            xq, scales = launchers.silu_mul_fp8(g, padded_width, static_scale)
            assert_same_fp8_rows(xq, scales, want_xq, want_scales)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_feed_fp8_rows_to_the_layer_with_the_same_product(dtype, monkeypatch):
    """CudaOps.rms_norm / silu_mul with `feeds` an FP8 layer return Fp8Rows; the product of those equals the product
    of the 16-bit rows bit for bit, eagerly and from a captured graph; a 16-bit `feeds` changes nothing."""
    rng = np.random.default_rng(8)
    ops = CudaOps()
    qkv = ops.quantize_linear(cupy.asarray(rng.standard_normal((640, 512)).astype(dtype)))  # [out, in]
    down = ops.quantize_linear(cupy.asarray(rng.standard_normal((512, 768)).astype(dtype)))
    x, residual = rows(rng, 33, 512, dtype), rows(rng, 33, 512, dtype)
    weight = cupy.asarray((1 + 0.5 * rng.standard_normal(512)).astype(dtype))
    gate_up = rows(rng, 33, 2 * 768, dtype)

    normed, residual_out = ops.rms_norm(x, weight, 1e-5, residual, feeds=qkv)
    activated = ops.silu_mul(gate_up, feeds=down)
    assert isinstance(normed, Fp8Rows) and normed.shape == (33, 512) and normed.dtype == dtype
    assert isinstance(activated, Fp8Rows) and activated.shape == (33, 768)
    plain_normed, plain_residual = ops.rms_norm(x, weight, 1e-5, residual)
    plain_activated = ops.silu_mul(gate_up)
    np.testing.assert_array_equal(residual_out.get().view(np.uint16), plain_residual.get().view(np.uint16))
    for fused, plain, layer in [(normed, plain_normed, qkv), (activated, plain_activated, down)]:
        np.testing.assert_array_equal((fused @ layer).get().view(np.uint16), (plain @ layer).get().view(np.uint16))

    # A decode graph: the fused kernel and the product captured, replayed on new inputs.
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = TunedGemm(stream)
    with stream:
        gemm(ops.rms_norm(x, weight, 1e-5, residual, feeds=qkv)[0], qkv)  # tunes the shape outside the capture
        stream.synchronize()
        with gc_paused():
            stream.begin_capture()
            held = ops.rms_norm(x, weight, 1e-5, residual, feeds=qkv)  # kept alive: the replay writes into it
            captured = gemm(held[0], qkv)
            graph = stream.end_capture()
    x[...] = rows(rng, 33, 512, dtype)
    cupy.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(captured.get().view(np.uint16),
                                  (ops.rms_norm(x, weight, 1e-5, residual)[0] @ qkv).get().view(np.uint16))

    # Switched off, or a 16-bit layer: plain arrays.
    monkeypatch.setattr(cuda_fp8_linear, "FUSED_FP8_INPUTS", False)
    assert isinstance(ops.rms_norm(x, weight, 1e-5, residual, feeds=qkv)[0], cupy.ndarray)
    monkeypatch.setattr(cuda_fp8_linear, "FUSED_FP8_INPUTS", True)
    assert isinstance(ops.silu_mul(gate_up, feeds=cupy.zeros((768, 512), dtype)), cupy.ndarray)


def product(rng, num_rows: int, width: int, padded: int, acc_dtype):
    """An FP8 GEMM's unscaled product (acc [R, Np] of `acc_dtype` at the magnitude e4m3 sums reach, x_scale [R],
    w_scale [Np] float32) and its width; row 1 zero."""
    acc = rng.standard_normal((num_rows, padded)) * 1e4
    if num_rows > 1:
        acc[1] = 0.0
    x_scale = 10.0 ** rng.uniform(-4, -1, num_rows)
    w_scale = 10.0 ** rng.uniform(-4, -2, padded)
    scales = tuple(cupy.asarray(a.astype(np.float32)) for a in (x_scale, w_scale))
    return (cupy.asarray(acc.astype(acc_dtype)), *scales, width)


@pytest.mark.parametrize("acc_dtype", ACC_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, hidden, padded", [(256, 4096, 4096), (7, 2048, 2048), (5, 40, 48), (3, 36, 48),
                                                      (2, 33_024, 33_024), (140, 17_408, 17_408)])
def test_rms_norm_fp8_reads_a_product_as_its_epilogue_writes_it(num_rows, hidden, padded, dtype, acc_dtype):
    rng = np.random.default_rng(hidden + num_rows)
    args = product(rng, num_rows, hidden, padded, acc_dtype)
    residual = rows(rng, num_rows, hidden, dtype)
    weight = cupy.asarray((1 + 0.5 * rng.standard_normal(hidden)).astype(dtype))
    x = scale_fp8_output(*args[:3], hidden, dtype)
    want_xq, want_scales, want_residual = launchers.rms_norm_fp8(x, weight, 1e-5, residual)
    xq, scales, residual_out = launchers.rms_norm_fp8(None, weight, 1e-5, residual, product=args)
    assert_same_fp8_rows(xq, scales, want_xq, want_scales)
    np.testing.assert_array_equal(residual_out.get().view(np.uint16), want_residual.get().view(np.uint16))
    assert (np.delete(scales.get(), 1) != 1.0).all()


@pytest.mark.parametrize("acc_dtype", ACC_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, inter, padded", [(256, 14_336, 28_672), (7, 8192, 16_384), (3, 36, 80),
                                                     (5, 40, 96), (2, 33_000, 66_000), (140, 16_800, 33_600)])
def test_silu_mul_fp8_reads_a_product_as_its_epilogue_writes_it(num_rows, inter, padded, dtype, acc_dtype):
    rng = np.random.default_rng(inter + num_rows)
    args = product(rng, num_rows, 2 * inter, padded, acc_dtype)
    gate_up = scale_fp8_output(*args[:3], 2 * inter, dtype)
    want_xq, want_scales = launchers.silu_mul_fp8(gate_up)
    xq, scales = launchers.silu_mul_fp8(None, product=args, dtype=dtype)
    assert_same_fp8_rows(xq, scales, want_xq, want_scales)
    if num_rows > 1:
        assert scales.get()[1] == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_deferred_layers_hand_their_product_to_rms_norm_and_silu_mul(dtype, monkeypatch):
    """CudaOps.deferred(layer) returns Fp8Product from `x @ layer` (eager and through a TunedGemm); rms_norm and
    silu_mul read it into the same bytes as from the layer's 16-bit output; materialize() is that output."""
    rng = np.random.default_rng(12)
    ops = CudaOps()
    o_proj = ops.quantize_linear(cupy.asarray(rng.standard_normal((512, 384)).astype(dtype)))  # [out, in]
    gate_up = ops.quantize_linear(cupy.asarray(rng.standard_normal((2 * 640, 512)).astype(dtype)))
    down = ops.quantize_linear(cupy.asarray(rng.standard_normal((512, 640)).astype(dtype)))
    x, residual = rows(rng, 29, 384, dtype), rows(rng, 29, 512, dtype)
    weight = cupy.asarray((1 + 0.5 * rng.standard_normal(512)).astype(dtype))
    twin = ops.deferred(o_proj)
    assert twin.deferred and not o_proj.deferred and ops.deferred(o_proj) is twin
    deferred_out = x @ twin
    plain_out = x @ o_proj
    assert isinstance(deferred_out, Fp8Product) and deferred_out.shape == (29, 512)
    np.testing.assert_array_equal(deferred_out.materialize().get().view(np.uint16), plain_out.get().view(np.uint16))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        through_gemm = TunedGemm(stream)(x, twin)  # the decode graphs' path
        stream.synchronize()
    assert isinstance(through_gemm, Fp8Product)
    np.testing.assert_array_equal(through_gemm.materialize().get().view(np.uint16), plain_out.get().view(np.uint16))

    fused, fused_residual = ops.rms_norm(deferred_out, weight, 1e-5, residual, feeds=gate_up)
    plain, plain_residual = ops.rms_norm(plain_out, weight, 1e-5, residual, feeds=gate_up)
    np.testing.assert_array_equal(fused.xq.get(), plain.xq.get())
    np.testing.assert_array_equal(fused_residual.get().view(np.uint16), plain_residual.get().view(np.uint16))
    up_deferred, up_plain = fused @ ops.deferred(gate_up), plain @ gate_up
    activated = ops.silu_mul(up_deferred, feeds=down)
    np.testing.assert_array_equal(activated.xq.get(), ops.silu_mul(up_plain, feeds=down).xq.get())
    np.testing.assert_array_equal((activated @ down).get().view(np.uint16),
                                  (ops.silu_mul(up_plain) @ down).get().view(np.uint16))
    # A consumer without an FP8 layer after it materializes the product first.
    np.testing.assert_array_equal(ops.silu_mul(up_deferred).get().view(np.uint16),
                                  ops.silu_mul(up_plain).get().view(np.uint16))

    monkeypatch.setattr(cuda_fp8_linear, "FUSED_FP8_INPUTS", False)
    assert ops.deferred(o_proj) is o_proj
    weight16 = cupy.zeros((384, 512), dtype)
    monkeypatch.setattr(cuda_fp8_linear, "FUSED_FP8_INPUTS", True)
    assert ops.deferred(weight16) is weight16


def qkv_product_case(rng, num_tokens: int, head_dim: int, dtype, acc_dtype, fp8_cache: bool, pad: int = 0):
    """(qkv product args (9 q heads, 3 KV heads; acc padded `pad` columns wider), positions, cos_sin table, slots,
    k_cache, v_cache, kv_scale) on the GPU: rope_write_kv_case's, the caches random bytes when FP8."""
    qkv, positions, table, slots, k_host, v_host = rope_write_kv_case(rng, num_tokens, head_dim, dtype, "same")
    width = qkv.shape[1]
    args = product(rng, num_tokens, width, width + pad, acc_dtype)
    if fp8_cache:
        k_host, v_host = (rng.integers(0, 256, k_host.shape).astype(np.uint8) for _ in range(2))
    kv_scale = cupy.asarray(np.array([0.05, 0.03], np.float32)) if fp8_cache else None
    return (args, cupy.asarray(positions), cupy.asarray(table), cupy.asarray(slots), k_host, v_host, kv_scale)


def cache_bits(a):
    return cupy.asnumpy(a).view(np.uint8)


@pytest.mark.parametrize("acc_dtype", ACC_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["cache-16bit", "cache-fp8"])
@pytest.mark.parametrize("num_tokens, head_dim, pad", [(1, 128, 0), (7, 64, 16), (300, 128, 0)])
def test_rope_write_kv_reads_a_qkv_product_as_its_epilogue_writes_it(num_tokens, head_dim, pad, fp8_cache, dtype,
                                                                      acc_dtype):
    """rope_write_kv_product = scale_fp8_output, then rope_write_kv of its q, k, v views: q, both caches (the rows
    of negative slots and untargeted rows untouched), byte for byte."""
    rng = np.random.default_rng([num_tokens, head_dim, pad])
    args, positions, table, slots, k_host, v_host, kv_scale = qkv_product_case(rng, num_tokens, head_dim, dtype,
                                                                               acc_dtype, fp8_cache, pad)
    qkv = scale_fp8_output(*args[:3], args[3], dtype)
    k_want, v_want = cupy.asarray(k_host), cupy.asarray(v_host)
    q_want = launchers.rope_write_kv(*split_qkv(qkv, 9, 3, head_dim), positions, table, k_want, v_want, slots,
                                     kv_scale=kv_scale)
    k_got, v_got = cupy.asarray(k_host), cupy.asarray(v_host)
    assert launchers.rope_write_kv_product_fits(args, dtype, head_dim, table)
    q_got = launchers.rope_write_kv_product(args, dtype, 9, positions, table, k_got, v_got, slots, kv_scale=kv_scale)
    assert q_got.dtype == dtype and q_got.shape == (num_tokens, 9, head_dim)
    np.testing.assert_array_equal(q_got.get().view(np.uint16), q_want.get().view(np.uint16))
    np.testing.assert_array_equal(cache_bits(k_got), cache_bits(k_want))
    np.testing.assert_array_equal(cache_bits(v_got), cache_bits(v_want))
    assert (cache_bits(k_got) != cache_bits(cupy.asarray(k_host))).any()  # it wrote something


def test_rope_write_kv_product_refuses_what_its_kernel_cannot_take():
    rng = np.random.default_rng(3)
    args, positions, table, slots, k_host, v_host, _ = qkv_product_case(rng, 4, 64, BF16, BF16, False)
    k_cache, v_cache = cupy.asarray(k_host), cupy.asarray(v_host)
    table32 = table.astype(np.float32)
    assert not launchers.rope_write_kv_product_fits(args, BF16, 64, table32)
    with pytest.raises(ValueError, match="cos_sin of the outputs' dtype"):
        launchers.rope_write_kv_product(args, BF16, 9, positions, table32, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="does not hold 8"):
        launchers.rope_write_kv_product(args, BF16, 8, positions, table, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="kv_scale is only for an FP8"):
        launchers.rope_write_kv_product(args, BF16, 9, positions, table, k_cache, v_cache, slots,
                                        kv_scale=cupy.ones(2, np.float32))


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["cache-16bit", "cache-fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_fold_the_qkv_epilogue_into_rope_write_kv(dtype, fp8_cache, monkeypatch):
    """CudaOps.qkv_rope_write_kv of a deferred FP8 qkv's product (one kernel) writes what it writes from the 16-bit
    output, and so do its fallbacks (FOLD_QKV_EPILOGUE off; a float32 cos_sin table the kernel does not take)."""
    from offline_paged.ops import ops_cuda
    from offline_paged.ops.kv_scales import KvScales

    rng = np.random.default_rng(21)
    ops = CudaOps()
    head_dim = 64
    qkv_layer = ops.quantize_linear(cupy.asarray(rng.standard_normal((15 * head_dim, 256)).astype(dtype)))
    x = rows(rng, 11, 256, dtype)
    _, positions, table, slots, k_host, v_host, _ = qkv_product_case(rng, 11, head_dim, dtype, BF16, fp8_cache)
    scales = KvScales(0.05, 0.03) if fp8_cache else None
    fp8 = {"kv_scales": scales} if fp8_cache else {}
    product_out = x @ ops.deferred(qkv_layer)
    assert isinstance(product_out, Fp8Product)
    results = []
    for qkv, cos_sin, fold in ((x @ qkv_layer, table, True), (product_out, table, True),
                               (product_out, table, False), (product_out, table.astype(np.float32), True)):
        monkeypatch.setattr(ops_cuda, "FOLD_QKV_EPILOGUE", fold)
        k_cache, v_cache = cupy.asarray(k_host), cupy.asarray(v_host)
        q = ops.qkv_rope_write_kv(qkv, 9, positions, cos_sin, k_cache, v_cache, slots, **fp8)
        results.append((q.get().view(np.uint16), cache_bits(k_cache), cache_bits(v_cache)))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            np.testing.assert_array_equal(a, b)


VECTOR_ROUNDING = r"""
#include "fp8.cuh"
extern "C" __global__ void to_e4m3x8(const float* x, uint2* out, long long num_vectors) {
  for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < num_vectors;
       v += (long long)gridDim.x * blockDim.x) {
    float f[8];
    for (int i = 0; i < 8; ++i) f[i] = x[v * 8 + i];
    out[v] = float8_to_e4m3x8(f);
  }
}
"""


def test_vector_e4m3_rounding_equals_ml_dtypes():
    x = _inputs()
    x = np.concatenate([x, -x[np.isnan(x)]])  # a negative NaN too
    x = np.concatenate([x, np.zeros(-x.size % 8, np.float32)])  # whole vectors of 8
    kernel = cupy.RawModule(code=inline_headers(VECTOR_ROUNDING), options=("--std=c++17",)).get_function("to_e4m3x8")
    out = cupy.empty(x.size, dtype=np.uint8)
    kernel((512,), (256,), (cupy.asarray(x), out, np.int64(x.size // 8)))
    got = out.get()
    finite_or_inf = ~np.isnan(x)
    expected = np.clip(x, -448, 448).astype(E4M3).view(np.uint8)
    wrong = finite_or_inf & (got != expected)
    assert not wrong.any(), f"{wrong.sum()} inputs differ, e.g. {x[wrong][:5]}: {got[wrong][:5]} != {expected[wrong][:5]}"
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[nan], np.where(np.signbit(x[nan]), 0xFF, 0x7F))


DIVISION = r"""
#include "fp8.cuh"
// counts[0]: quotients whose e4m3 bytes differ from __fdiv_rn's; counts[1]: quotients of at least 2^-10 (e4m3's
// range) whose float32 bits differ.
extern "C" __global__ void divide_both(const float* x, const float* scales, long long num_x, long long num_pairs,
                                       unsigned long long* counts) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < num_pairs;
       i += (long long)gridDim.x * blockDim.x) {
    const float s = scales[i / num_x], v = x[i % num_x];
    const float got = fp8_divisor(s)(v), want = __fdiv_rn(v, s);
    if (float_to_e4m3(got) != float_to_e4m3(want)) atomicAdd(&counts[0], 1ull);
    if (fabsf(want) >= 0x1p-10f && __float_as_uint(got) != __float_as_uint(want)) atomicAdd(&counts[1], 1ull);
  }
}
"""


def test_fp8_divisor_quantizes_as_ieee_division_does():
    """fp8.cuh's Fp8Divisor (a row's reciprocal once, then a product and two FMAs a value) gives __fdiv_rn's e4m3
    bytes for every fp16 and bf16 value (NaN, infinities, zeros of both signs and subnormals among them) over scales
    from 2^-70 to 2^70 (its fast range [2^-60, 2^60] and beyond; significands 1, 1 + 2^-23, 2 - 2^-23 among them),
    and __fdiv_rn's float32 bits wherever the quotient reaches e4m3's range."""
    every16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    as_bf16 = (every16.astype(np.uint32) << 16).view(np.float32)
    x = np.concatenate([every16.view(np.float16).astype(np.float32), as_bf16])
    rng = np.random.default_rng(5)
    significands = np.concatenate([[1.0, 1 + 2.0 ** -23, 2 - 2.0 ** -23, 1.5, 1 + 2.0 ** -22], rng.uniform(1, 2, 6)])
    scales = np.ldexp(significands[None, :], np.arange(-70, 71, 7)[:, None]).astype(np.float32).ravel()
    scales = np.concatenate([scales, np.float32([1 / 448, 448.0, 2.0 ** -60, 2.0 ** 60, 3e-3, 0.0217])])
    module = cupy.RawModule(code=inline_headers(DIVISION), options=("--std=c++17",))
    counts = cupy.zeros(2, dtype=np.uint64)
    module.get_function("divide_both")((1024,), (256,), (cupy.asarray(x), cupy.asarray(scales), np.int64(x.size),
                                                         np.int64(x.size * scales.size), counts))
    assert counts.get().tolist() == [0, 0], f"{counts.get()} of {x.size * scales.size} quotients differ"


def test_rows_made_for_another_layer_are_refused():
    ops = CudaOps()
    layer = CudaFp8Linear.quantize(cupy.ones((64, 96), np.float16))  # in 96, padded 96
    other = CudaFp8Linear.quantize(cupy.ones((64, 100), np.float16))  # in 100, padded 112
    x, weight = cupy.ones((4, 100), np.float16), cupy.ones(100, np.float16)
    fused, _ = ops.rms_norm(x, weight, 1e-5, feeds=other)
    with pytest.raises(ValueError, match="do not fit an FP8 weight"):
        layer.apply(fused, TunedGemm(cupy.cuda.Stream(non_blocking=True)))
    with pytest.raises(ValueError, match="padded_width must be a multiple of 16"):
        launchers.rms_norm_fp8(x, weight, 1e-5, padded_width=104)
    with pytest.raises(ValueError, match="static_scale must be a positive finite number"):
        launchers.silu_mul_fp8(cupy.ones((4, 64), np.float16), static_scale=float("nan"))
