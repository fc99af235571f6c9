"""Attention's output quantized for an FP8 o_proj by the decode kernel itself (launchers.paged_attention's `quantize`,
attention.cu's quantize_token_row, CudaOps.attention's `feeds`; off by default, FUSED_ATTENTION_QUANTIZE, until it
is shown to be faster, so the tests switch it on): byte for byte the plain launch followed by
fp8_launcher.quantize_rows_fp8, which tests/test_ops_cuda_fp8_linear.py checks against the NumPy reference. Needs a
GPU.

What is checked, in fp16 and bf16, over 16-bit and FP8 pools with shuffled block tables: the e4m3 bytes and float32
row scales equal the two-launch path's, and the 16-bit output is the plain launch's, for the decode kernel (8-row
tiles: 4 and 8 heads a KV head, head dims 128 and 64) and the key-split one (16 heads a KV head: two CTAs of a KV
head meet in one row), with a launch order, a static scale, padding to a wider GEMM input, a row of zeros and a row
holding a NaN (scale 1, as quantize_rows_fp8 gives); the kernel path is the one taken (the quantize launch after it is
made to fail). Replayed from a CUDA graph many times, the counters the CTAs meet in return to zero and the bytes stay
the same. Where the kernel cannot quantize (several key splits, rows of no sequence, longer queries) the launch after
it gives the same bytes. CudaOps.attention with `feeds` an FP8 layer hands it Fp8Rows whose product equals the plain
rows' product, and a 16-bit `feeds` gets the plain rows.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from test_launchers import DTYPES, make_paged_case  # noqa: E402
from test_ops_cuda_fp8 import scale_buffer, to_fp8_case  # noqa: E402

from offline_paged.ops import launchers  # noqa: E402  (needs cupy)
from offline_paged.ops.attention import AttentionMetadata  # noqa: E402
from offline_paged.ops.cuda_fp8_linear import Fp8Rows  # noqa: E402
from offline_paged.ops.fp8_launcher import quantize_rows_fp8  # noqa: E402
from offline_paged.ops.graphs import gc_paused  # noqa: E402
from offline_paged.ops.ops_cuda import CudaOps  # noqa: E402

# (sequences, kv heads, heads a kv head, head dim): Llama 8B's decode shape, 8 heads a kv head, the key-split kernel
# (16 rows a token), head dim 64.
SHAPES = [(37, 8, 4, 128), (9, 4, 8, 128), (6, 2, 16, 64), (20, 4, 4, 64)]
FP8_CACHE = [pytest.param(False, id="cache-16bit"), pytest.param(True, id="cache-fp8")]


def decode_case(rng, num_seqs, num_kv_heads, group, head_dim, dtype, fp8_cache):
    """One query token per sequence, contexts 1..300 (block size 16), a zero row (sequence 1's values all 0) and a
    NaN row (a value sequence 2 reads is NaN), on a 16-bit or an FP8 pool: (q, k, v, tables, ctx, qsl) host arrays."""
    seqs = [(1, int(c)) for c in rng.integers(1, 300, num_seqs)]
    case = make_paged_case(rng, seqs, 16, num_kv_heads, head_dim, group, dtype=dtype)
    q, k, v, tables, ctx, qsl = to_fp8_case(case) if fp8_cache else case
    slots = lambda s: tables[s, np.arange(ctx[s]) // 16] * 16 + np.arange(ctx[s]) % 16  # noqa: E731
    flat_v = v.reshape(-1, num_kv_heads, head_dim)
    flat_v[slots(1)] = 0
    flat_v[slots(2)[0], 0, 3] = 0x7F if fp8_cache else np.nan  # e4m3fn's NaN bits
    return q, k, v, tables, ctx, qsl


def launch(case, fp8_cache, **kwargs):
    q, k, v, tables, ctx, qsl = case
    return launchers.paged_attention(
        cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(tables), cupy.asarray(ctx), cupy.asarray(qsl),
        int(np.diff(qsl).max()), int(ctx.max()), q.shape[2] ** -0.5, kv_scale=scale_buffer() if fp8_cache else None,
        **kwargs)


def assert_quantized_as_after(fused, plain, padded=None, static=None):
    """fused = (out, xq, scales) equals the plain output and quantize_rows_fp8 of it, byte for byte."""
    out, xq, scales = fused
    want_xq, want_scales = quantize_rows_fp8(plain.reshape(plain.shape[0], -1), padded, static)
    np.testing.assert_array_equal(out.get().view(np.uint16), plain.get().view(np.uint16))
    np.testing.assert_array_equal(scales.get(), want_scales.get())
    np.testing.assert_array_equal(xq.get(), want_xq.get())


def no_launch_after(monkeypatch):
    """The fused path switched on (FUSED_ATTENTION_QUANTIZE, off by default), and the launch after the kernel made to
    fail."""
    def fail(*args):
        raise AssertionError("the attention kernel should have quantized these rows itself")

    monkeypatch.setattr(launchers, "FUSED_ATTENTION_QUANTIZE", True)
    monkeypatch.setattr(launchers, "_quantize_rows_after", fail)


@pytest.mark.parametrize("fp8_cache", FP8_CACHE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_seqs, num_kv_heads, group, head_dim", SHAPES)
def test_the_decode_kernel_quantizes_its_rows_as_quantize_rows_fp8(num_seqs, num_kv_heads, group, head_dim, dtype,
                                                                    fp8_cache, monkeypatch):
    rng = np.random.default_rng(num_seqs * 31 + group + head_dim)
    case = decode_case(rng, num_seqs, num_kv_heads, group, head_dim, dtype, fp8_cache)
    plain = launch(case, fp8_cache, num_splits=1, zero_fill=False)
    bits = plain.get().view(np.uint16) & 0x7FFF  # [T, H, D] magnitudes' bits
    assert np.isnan(plain.get()[2].astype(np.float32)).any() and not bits[1].any()  # the NaN and zero rows
    no_launch_after(monkeypatch)
    assert_quantized_as_after(launch(case, fp8_cache, num_splits=1, zero_fill=False, quantize=(None, None)), plain)
    scales = launch(case, fp8_cache, num_splits=1, zero_fill=False, quantize=(None, None))[2].get()
    assert scales[1] == 1.0 and scales[2] == 1.0  # zero and NaN rows
    width = num_kv_heads * group * head_dim
    order = cupy.asarray(rng.permutation(num_seqs).astype(np.int32))
    assert_quantized_as_after(launch(case, fp8_cache, num_splits=1, zero_fill=False, launch_order=order,
                                     quantize=(width + 32, 0.05)), plain, width + 32, 0.05)


@pytest.mark.parametrize("dtype", DTYPES)
def test_replays_leave_the_counters_at_zero_and_give_the_same_bytes(dtype, monkeypatch):
    rng = np.random.default_rng(5)
    case = decode_case(rng, 37, 8, 4, 128, dtype, fp8_cache=True)
    plain = launch(case, True, num_splits=1, zero_fill=False)
    no_launch_after(monkeypatch)
    first = launch(case, True, num_splits=1, zero_fill=False, quantize=(None, None))  # the counters made eagerly
    stream = cupy.cuda.Stream(non_blocking=True)
    inputs = [cupy.asarray(a) for a in case]
    q, k, v, tables, ctx, qsl = inputs
    kv_scale = scale_buffer()
    with stream:
        with gc_paused():
            stream.begin_capture()
            held = [launchers.paged_attention(q, k, v, tables, ctx, qsl, 1, int(case[4].max()), 128 ** -0.5,
                                              num_splits=1, zero_fill=False, kv_scale=kv_scale, quantize=(None, None))
                    for _ in range(3)]  # three layers
            graph = stream.end_capture()
        for _ in range(5):
            graph.launch(stream)
        stream.synchronize()
    for fused in held:
        assert_quantized_as_after(fused, plain)
        np.testing.assert_array_equal(fused[1].get(), first[1].get())
    assert not launchers._row_sync_buffers[cupy.cuda.Device().id].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_where_the_kernel_cannot_quantize_a_launch_after_it_does(dtype, monkeypatch):
    rng = np.random.default_rng(9)
    case = decode_case(rng, 11, 4, 4, 128, dtype, fp8_cache=False)
    after = []
    monkeypatch.setattr(launchers, "FUSED_ATTENTION_QUANTIZE", True)
    real = launchers._quantize_rows_after
    monkeypatch.setattr(launchers, "_quantize_rows_after", lambda *args: after.append(1) or real(*args))
    for kwargs in [dict(num_splits=3, zero_fill=False), dict(num_splits=1, zero_fill=True)]:
        assert_quantized_as_after(launch(case, False, quantize=(None, None), **kwargs), launch(case, False, **kwargs))
    assert len(after) == 2
    # Longer queries (a chunk of 3 tokens each): several tokens in one CTA's rows.
    seqs = [(3, int(c)) for c in rng.integers(3, 200, 7)]
    chunked = make_paged_case(rng, seqs, 16, 4, 128, 4, dtype=dtype)
    assert_quantized_as_after(launch(chunked, False, num_splits=1, zero_fill=False, quantize=(None, None)),
                              launch(chunked, False, num_splits=1, zero_fill=False))
    assert len(after) == 3
    monkeypatch.setattr(launchers, "FUSED_ATTENTION_QUANTIZE", False)  # switched off (the default)
    assert_quantized_as_after(launch(case, False, num_splits=1, zero_fill=False, quantize=(None, None)),
                              launch(case, False, num_splits=1, zero_fill=False))
    assert len(after) == 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_attention_hands_an_fp8_o_proj_its_rows(dtype, monkeypatch):
    rng = np.random.default_rng(12)
    ops = CudaOps()
    q, k, v, tables, ctx, qsl = decode_case(rng, 37, 8, 4, 128, dtype, fp8_cache=False)
    o_proj = ops.quantize_linear(cupy.asarray(rng.standard_normal((512, 4096)).astype(dtype)))  # [out, in]
    meta = AttentionMetadata(cupy.zeros(37, cupy.int32), cupy.asarray(tables), cupy.asarray(ctx), cupy.asarray(qsl),
                             1, int(ctx.max()), unqueried_rows=False)
    args = (cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), meta, 128 ** -0.5)
    no_launch_after(monkeypatch)
    rows = ops.attention(*args, feeds=o_proj)
    assert isinstance(rows, Fp8Rows) and rows.shape == (37, 4096) and rows.dtype == dtype
    plain = ops.attention(*args)  # [T, H, D]
    assert plain.shape == (37, 32, 128)
    np.testing.assert_array_equal((rows @ o_proj).get().view(np.uint16),
                                  (plain.reshape(37, -1) @ o_proj).get().view(np.uint16))
    as_rows = ops.attention(*args, feeds=cupy.zeros((4096, 512), dtype))  # a 16-bit o_proj: the plain rows
    np.testing.assert_array_equal(as_rows.get().view(np.uint16), plain.reshape(37, -1).get().view(np.uint16))
