"""The FP8 (e4m3) KV cache's CUDA kernels against the NumPy FP8 reference, in fp16 and bf16. Needs a GPU.

What is checked: the KV write (cache.cu write_kv_fp8, through CudaOps with a calculated KvScales too) stores
exactly the reference's bytes, saturation and negative slots included; rope_write_kv's FP8 path stores the
bytes of rope followed by that write and returns rope's q; every attention kernel (decode key-split, row-split,
the FlashAttention-2 prefill kernel; head dims 64 and 128; GQA; block sizes 16 and 5; planned and forced key
splits; sliding windows) on an FP8 pool with shuffled block tables equals the reference on the same pool
within the 16-bit tolerance, with K and V scales other than 1; copy_blocks and the swapper move the bytes.
The pool is uint8 (the e4m3 bits). Slots that hold no token store 448 (e4m3's largest), so a kernel that reads
one skews the softmax and fails.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from test_launchers import DTYPES, TOL, assert_close, free_blocks_before_windows, make_paged_case  # noqa: E402

from offline_paged.models.simple_runner import build_metadata  # noqa: E402
from offline_paged.ops import launchers  # noqa: E402  (needs cupy)
from offline_paged.ops.attention import AttentionMetadata, paged_attention_reference, write_kv_reference  # noqa: E402
from offline_paged.ops.kv_scales import FP8_E4M3, KvScales, quantize_fp8  # noqa: E402
from offline_paged.ops.ops_cuda import CudaOps  # noqa: E402
from offline_paged.ops.ops_numpy import NumpyOps  # noqa: E402
from offline_paged.ops.swap import BlockSwapper  # noqa: E402

K_SCALE, V_SCALE = 0.37, 1.9  # not 1: the kernels must apply both
LARGEST = 0x7E  # e4m3 448: what empty slots hold


def scale_buffer(k_scale=K_SCALE, v_scale=V_SCALE):
    return cupy.asarray(np.array([k_scale, v_scale], dtype=np.float32))


def to_fp8_case(case, k_scale=K_SCALE, v_scale=V_SCALE):
    """make_paged_case's 16-bit case with its caches quantized (x / scale) to e4m3 bits, NaN slots -> 448."""
    q, k_cache, v_cache, tables, ctx, qsl = case
    pools = []
    for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)):
        bits = quantize_fp8(cache.astype(np.float32), scale).view(np.uint8).copy()
        bits[(bits & 0x7F) == 0x7F] = LARGEST  # NaN: a slot that holds no token
        pools.append(bits)
    return q, pools[0], pools[1], tables, ctx, qsl


def run_fp8_attention(case, num_splits=None, window=0, kernel=None):
    """(kernel output, reference on the same FP8 pool) as float arrays [T, H, D]."""
    q, k_bits, v_bits, tables, ctx, qsl = case
    scale = q.shape[2] ** -0.5
    q_lens = np.diff(qsl)
    out = launchers.paged_attention(
        cupy.asarray(q), cupy.asarray(k_bits), cupy.asarray(v_bits), cupy.asarray(tables), cupy.asarray(ctx),
        cupy.asarray(qsl), int(q_lens.max()), int(ctx.max()), scale, num_splits=num_splits, window=window,
        kernel=kernel, kv_scale=scale_buffer())
    assert out.dtype == q.dtype
    meta = AttentionMetadata(np.zeros(len(q), np.int32), tables, ctx, qsl, int(q_lens.max()), int(ctx.max()))
    ref = paged_attention_reference(np, q.astype(np.float32), k_bits.view(FP8_E4M3), v_bits.view(FP8_E4M3), meta,
                                    scale, window or None, K_SCALE, V_SCALE)
    return out.get(), ref


def kv_rows(rng, dtype, num_tokens, num_kv_heads, head_dim):
    """k, v [T, Hkv, D] of `dtype` with some entries past 448 x scale (they must saturate)."""
    k = 2.0 * rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    v = 2.0 * rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    k[0, 0, :4] = [1e3, -1e3, 448 * K_SCALE * 1.01, -1e-4]
    v[-1, -1, :3] = [5e3, -900.0, 3e-6]
    return k.astype(dtype), v.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_stores_the_reference_bytes(dtype):
    rng = np.random.default_rng(0)
    k, v = kv_rows(rng, dtype, 37, 2, 64)
    slots = rng.permutation(8 * 16)[:37].astype(np.int32)
    slots[[3, 20]] = -1
    k_cache = rng.integers(0, 256, (8, 16, 2, 64), dtype=np.uint8)  # whatever was there before
    v_cache = rng.integers(0, 256, (8, 16, 2, 64), dtype=np.uint8)
    k_gpu, v_gpu = cupy.asarray(k_cache), cupy.asarray(v_cache)
    launchers.write_kv(cupy.asarray(k), cupy.asarray(v), k_gpu, v_gpu, cupy.asarray(slots), kv_scale=scale_buffer())
    k_ref, v_ref = k_cache.view(FP8_E4M3).copy(), v_cache.view(FP8_E4M3).copy()
    write_kv_reference(np, k.astype(np.float32), v.astype(np.float32), k_ref, v_ref, slots, K_SCALE, V_SCALE)
    np.testing.assert_array_equal(k_gpu.get(), k_ref.view(np.uint8))
    np.testing.assert_array_equal(v_gpu.get(), v_ref.view(np.uint8))
    assert (k_ref.view(np.uint8) == LARGEST).any()  # saturation was exercised


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_calculate_the_scales_numpy_ops_calculate(dtype):
    """A KvScales to calculate takes vLLM's max / 200, max / 100 from the rows with a slot, on both
    backends alike, and the bytes written with them agree."""
    rng = np.random.default_rng(1)
    k, v = kv_rows(rng, dtype, 20, 2, 64)
    slots = np.arange(20, dtype=np.int32)
    slots[0] = -1  # the row holding k's 1e3 is padding: it must not set the scale
    gpu_scales, cpu_scales = KvScales(calculate=True), KvScales(calculate=True)
    k_gpu, v_gpu = cupy.zeros((4, 16, 2, 64), cupy.uint8), cupy.zeros((4, 16, 2, 64), cupy.uint8)
    CudaOps().write_kv(cupy.asarray(k), cupy.asarray(v), k_gpu, v_gpu, slots, kv_scales=gpu_scales)
    k_ref, v_ref = np.zeros((4, 16, 2, 64), FP8_E4M3), np.zeros((4, 16, 2, 64), FP8_E4M3)
    NumpyOps().write_kv(k.astype(np.float32), v.astype(np.float32), k_ref, v_ref, slots, kv_scales=cpu_scales)
    assert (gpu_scales.k_scale, gpu_scales.v_scale) == (cpu_scales.k_scale, cpu_scales.v_scale)
    assert not gpu_scales.calculate and gpu_scales.k_scale < 1e3 / 200
    np.testing.assert_array_equal(k_gpu.get(), k_ref.view(np.uint8))
    np.testing.assert_array_equal(v_gpu.get(), v_ref.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_write_kv_stores_the_bytes_of_rope_then_write_kv(dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    num_tokens, heads, kv_heads = 29, 8, 2
    qkv = cupy.asarray(rng.standard_normal((num_tokens, (heads + 2 * kv_heads) * head_dim)).astype(dtype))
    q = qkv[:, :heads * head_dim].reshape(num_tokens, heads, head_dim)  # row-strided views, as the model's
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(num_tokens, kv_heads, head_dim)
    positions = cupy.asarray(rng.integers(0, 500, num_tokens).astype(np.int32))
    freqs = np.outer(np.arange(512), 1e4 ** (-np.arange(head_dim // 2) / (head_dim // 2)))
    table = cupy.asarray(np.concatenate([np.cos(freqs), np.sin(freqs)], axis=1).astype(np.float32))
    slots = rng.permutation(4 * 16)[:num_tokens].astype(np.int32)
    slots[5] = -1
    slots = cupy.asarray(slots)
    shape = (4, 16, kv_heads, head_dim)
    k_got, v_got, k_want, v_want = (cupy.zeros(shape, cupy.uint8) for _ in range(4))
    q_got = launchers.rope_write_kv(q, k, v, positions, table, k_got, v_got, slots, kv_scale=scale_buffer())
    q_want, k_rotated = launchers.rope(q, k, positions, table)
    launchers.write_kv(k_rotated, v, k_want, v_want, slots, kv_scale=scale_buffer())
    np.testing.assert_array_equal(q_got.get().view(np.uint16), q_want.get().view(np.uint16))
    np.testing.assert_array_equal(k_got.get(), k_want.get())
    np.testing.assert_array_equal(v_got.get(), v_want.get())
    assert k_got.get().any() and v_got.get().any()


# (q_len, context_len): decodes, a chunk on a cached prefix, a prefill longer than a tile, q_len no multiple
# of any tile, a one-token sequence.
MIXED = [(1, 77), (130, 500), (1, 1000), (7, 7), (300, 300), (45, 46), (1, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["decode", "keysplit", "rowsplit", "prefill"])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (64, 1), (128, 8)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_every_attention_kernel_matches_the_reference_on_an_fp8_pool(block_size, head_dim, group, kernel, dtype):
    rng = np.random.default_rng([block_size, head_dim, group])
    case = to_fp8_case(make_paged_case(rng, MIXED, block_size, 2, head_dim, group, dtype=dtype))
    for num_splits in (None, 1, 3):
        out, ref = run_fp8_attention(case, num_splits=num_splits, kernel=kernel)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [None, "decode", "keysplit", "rowsplit", "prefill"])
@pytest.mark.parametrize("window", [20, 64, 200])
@pytest.mark.parametrize("head_dim", [128, 64])  # the decode tiles' register path and their dense ring
def test_sliding_window_on_an_fp8_pool(head_dim, window, kernel, dtype):
    """Blocks wholly before each sequence's first window point at a block of 448s (freed blocks)."""
    rng = np.random.default_rng(window)
    case = make_paged_case(rng, [(1, 300), (150, 700), (40, 233), (1, 2100), (129, 129)], 16, 2, head_dim, 4,
                           spare_blocks=1, dtype=dtype)
    case = to_fp8_case(case)
    used = {int(b) for s, c in enumerate(case[4].tolist()) for b in case[3][s, :-(-c // 16)]}
    (spare,) = set(range(case[1].shape[0])) - used
    assert free_blocks_before_windows(case, window, spare) > 0
    for num_splits in (None, 1, 4):
        out, ref = run_fp8_attention(case, num_splits=num_splits, window=window, kernel=kernel)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_attention_with_leading_decodes_on_an_fp8_pool(dtype):
    """CudaOps.attention splits a mixed step into a decode launch and a prefill launch; both read the
    layer's KvScales through its device buffer."""
    from dataclasses import replace

    rng = np.random.default_rng(9)
    contexts, qlens = [33, 100, 7, 250, 90, 70], [1, 1, 1, 1, 40, 70]
    case = to_fp8_case(make_paged_case(rng, list(zip(qlens, contexts)), 16, 2, 64, 4, dtype=dtype))
    q, k_bits, v_bits, tables, ctx, qsl = case
    tables_list = [list(map(int, tables[s, :-(-c // 16)])) for s, c in enumerate(contexts)]
    meta = build_metadata(np, tables_list, contexts, qlens, [-1] * sum(qlens))
    want = NumpyOps().attention(q.astype(np.float32), k_bits.view(FP8_E4M3), v_bits.view(FP8_E4M3), meta, 0.125,
                                kv_scales=KvScales(K_SCALE, V_SCALE))
    meta_gpu = build_metadata(cupy, tables_list, contexts, qlens, [-1] * sum(qlens))
    ops, scales = CudaOps(), KvScales(K_SCALE, V_SCALE)
    k_gpu, v_gpu = cupy.asarray(k_bits), cupy.asarray(v_bits)
    for leading in (0, 4):
        got = ops.attention(cupy.asarray(q), k_gpu, v_gpu, replace(meta_gpu, num_leading_decodes=leading), 0.125,
                            kv_scales=scales).get()
        assert_close(got, want, TOL[dtype])


def test_copy_blocks_and_swap_move_fp8_bytes():
    rng = np.random.default_rng(2)
    pool = rng.integers(0, 256, (2, 2, 8, 16, 2, 64), dtype=np.uint8)  # [L, 2, N, B, Hkv, D]
    for src, dst in (([0, 3], [5, 6]), ([1, 2], [2, 7])):  # the second is a chain (block 2 read, then written)
        expected = pool.copy()
        NumpyOps().copy_blocks(expected, np.array(src), np.array(dst))
        gpu = cupy.asarray(pool)
        CudaOps().copy_blocks(gpu, src, dst)
        np.testing.assert_array_equal(gpu.get(), expected)
    gpu = cupy.asarray(pool)
    swapper = BlockSwapper(gpu, 4)
    swapper.swap_out([1, 6], [3, 0])
    gpu[:, :, [1, 6]] = 0
    swapper.swap_in([3, 0], [2, 4])
    np.testing.assert_array_equal(gpu.get()[:, :, [2, 4]], pool[:, :, [1, 6]])


def test_a_kv_scale_for_a_16_bit_cache_or_a_missing_one_is_refused():
    q = cupy.zeros((1, 4, 64), cupy.float16)
    cache16, cache8 = cupy.zeros((2, 16, 2, 64), cupy.float16), cupy.zeros((2, 16, 2, 64), cupy.uint8)
    ints, one = cupy.zeros((1, 1), cupy.int32), cupy.ones(1, cupy.int32)
    qsl = cupy.asarray(np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="only for an FP8"):
        launchers.paged_attention(q, cache16, cache16, ints, one, qsl, 1, 1, 1.0, kv_scale=scale_buffer())
    with pytest.raises(ValueError, match="kv_scale must be a cupy.ndarray"):
        launchers.paged_attention(q, cache8, cache8, ints, one, qsl, 1, 1, 1.0)
    with pytest.raises(ValueError, match="kv_scale must hold"):
        launchers.paged_attention(q, cache8, cache8, ints, one, qsl, 1, 1, 1.0,
                                  kv_scale=cupy.ones(3, cupy.float32))


_DEQUANT_ALL = r"""
#include "fp8.cuh"
#include "common.cuh"
extern "C" __global__ void dequant_all(const uint2* bytes, uint4* as_half, uint4* as_bf16) {
  const int i = threadIdx.x;  // 8 bytes each: 32 threads cover 0..255
  as_half[i] = e4m3x8_to<__half>(bytes[i]);
  as_bf16[i] = e4m3x8_to<bf16_t>(bytes[i]);
}
"""


def test_every_e4m3_byte_dequantizes_exactly_to_fp16_and_bf16():
    """The attention kernels' e4m3 -> T conversion (cuda/common.cuh e4m3x8_to) of each of the 256 bytes
    equals ml_dtypes' value exactly in both 16-bit types, zeros and subnormals included. The two NaN bytes
    (the pool never holds them: writes saturate at 448) read as NaN in fp16 (the hardware's cvt on sm_89+) and
    as +-480 in bf16 (the bit path)."""
    from offline_paged.ops.kernel_modules import COMPILE_OPTIONS, inline_headers

    module = cupy.RawModule(code=inline_headers(_DEQUANT_ALL), options=COMPILE_OPTIONS)
    every = cupy.arange(256, dtype=cupy.uint8)
    as_half = cupy.zeros(256, dtype=cupy.float16)
    as_bf16 = cupy.zeros(256, dtype=cupy.uint16)
    module.get_function("dequant_all")((1,), (32,), (every, as_half, as_bf16))
    expected = np.arange(256, dtype=np.uint8).view(FP8_E4M3).astype(np.float32)  # [256]
    nan = np.isnan(expected)
    assert nan.sum() == 2
    expected_half = expected.copy() if int(cupy.cuda.Device().compute_capability) >= 89 else None
    expected[nan] = np.copysign(480.0, np.where(np.arange(256)[nan] >= 128, -1.0, 1.0))
    half = as_half.get().astype(np.float32)
    bf16 = (as_bf16.get().astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(half, expected if expected_half is None else expected_half)
    np.testing.assert_array_equal(bf16, expected)
    assert np.signbit(half[128]) and np.signbit(bf16[128]) and not np.signbit(bf16[0])  # -0 stays -0
