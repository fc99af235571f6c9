"""Every CUDA kernel against the NumPy reference on random inputs, in fp16 and in bf16 (each with its own
tolerance: the reference gets the same rounded inputs in fp32, so what is left is the kernel's own
rounding of probabilities and outputs, ~2^-11 relative for fp16 and ~2^-8 for bf16). Needs a GPU.

Attention cases cover shuffled block tables, context lengths 1 / block boundary +-1 / not multiples of
the block size / up to 32k, block sizes 8, 16, 32, GQA ratios 1, 3, 4, 8, head dims 64 and 128,
decode, prefill, chunked prefill and mixed batches, forced split counts, and sliding windows. The cache
is filled with NaN wherever no token lives, so a kernel that reads past a context (or a padding block,
or a block wholly before a sliding window) fails loudly.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from offline_paged.ops.attention import paged_attention_reference, write_kv_reference
from offline_paged.ops.ops_numpy import NumpyOps

cupy = pytest.importorskip("cupy")
import ml_dtypes  # noqa: E402  (bf16 arrays; a GPU run without it must fail, not skip)
pytestmark = pytest.mark.gpu

from offline_paged.ops import launchers  # noqa: E402  (needs cupy)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [pytest.param(np.dtype(np.float16), id="fp16"), pytest.param(BF16, id="bf16")]
# Largest |error| / max |reference| accepted: fp16 keeps 10 mantissa bits, bf16 7.
TOL = {np.dtype(np.float16): 1e-2, BF16: 2.5e-2}


def assert_close(actual, expected, rel=1e-2):
    """Tolerance relative to the largest reference magnitude (outputs of long softmaxes are small)."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert np.isfinite(actual).all(), "kernel output has NaN/inf"
    scale = max(np.abs(expected).max(), 1e-6)
    err = np.abs(actual - expected).max()
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} * max|ref| {scale:.3g}"


def make_paged_case(rng, seqs, block_size, num_kv_heads, head_dim, group, spare_blocks=3, dtype=np.float16):
    """seqs: [(q_len, context_len)]. Returns host arrays (q, k_cache, v_cache, tables, ctx, qsl) of
    `dtype` where every slot that holds no token is NaN and block tables are a shuffled draw from the pool."""
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = rng.permutation(num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = np.full(shape, np.nan, dtype=np.float32)
    v_cache = np.full(shape, np.nan, dtype=np.float32)
    tables = np.zeros((len(seqs), max(max(blocks_per_seq), 1)), dtype=np.int32)
    used = 0
    for i, ((_, ctx), nb) in enumerate(zip(seqs, blocks_per_seq)):
        tables[i, :nb] = order[used:used + nb]
        used += nb
        positions = np.arange(ctx)
        slots = tables[i, positions // block_size] * block_size + positions % block_size
        k_cache.reshape(-1, num_kv_heads, head_dim)[slots] = rng.standard_normal((ctx, num_kv_heads, head_dim))
        v_cache.reshape(-1, num_kv_heads, head_dim)[slots] = rng.standard_normal((ctx, num_kv_heads, head_dim))
    q_lens = [ql for ql, _ in seqs]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    # Larger q makes the softmax peaked, so an off-by-one key shows up as a large error.
    q = (1.5 * rng.standard_normal((int(qsl[-1]), num_kv_heads * group, head_dim))).astype(dtype)
    ctx = np.array([c for _, c in seqs], dtype=np.int32)
    return q, k_cache.astype(dtype), v_cache.astype(dtype), tables, ctx, qsl


def windowed_attention_reference(q, k_cache, v_cache, tables, ctx, qsl, scale, window):
    """Sliding-window causal GQA attention in float64, written out here (the kernels' definition): a
    query at position p sees keys p - window < k <= p. Gathers only keys some query can see, so NaN
    in blocks wholly before every window never reaches it. Returns [T, H, D] float64."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros(q.shape, dtype=np.float64)
    for s, context_len in enumerate(ctx.tolist()):
        q_start, q_end = int(qsl[s]), int(qsl[s + 1])
        for t in range(q_start, q_end):
            pos = context_len - (q_end - q_start) + (t - q_start)
            keys = np.arange(max(0, pos - window + 1), pos + 1)  # [C] visible key positions
            slots = tables[s, keys // block_size] * block_size + keys % block_size
            k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].astype(np.float64)  # [C, Hkv, D]
            v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].astype(np.float64)  # [C, Hkv, D]
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [C, H, D]
            scores = np.einsum("hd,khd->hk", q[t].astype(np.float64), k) * scale  # [H, C]
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[t] = np.einsum("hk,khd->hd", probs, v)
    return out


def run_attention(case, num_splits=None, window=0, kernel=None):
    from offline_paged.ops.attention import AttentionMetadata

    q, k_cache, v_cache, tables, ctx, qsl = case
    scale = q.shape[2] ** -0.5
    q_lens = np.diff(qsl)
    out = launchers.paged_attention(
        cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache), cupy.asarray(tables), cupy.asarray(ctx),
        cupy.asarray(qsl), int(q_lens.max()), int(ctx.max()), scale, num_splits=num_splits, window=window,
        kernel=kernel)
    assert out.dtype == q.dtype
    if window:
        return out.get(), windowed_attention_reference(q, k_cache, v_cache, tables, ctx, qsl, scale, window)
    # The reference multiplies NaN-free gathers only, so NaN slots never reach it.
    meta = AttentionMetadata(np.zeros(len(q), np.int32), tables, ctx, qsl, int(q_lens.max()), int(ctx.max()))
    ref = paged_attention_reference(np, q.astype(np.float32), k_cache.astype(np.float32),
                                    v_cache.astype(np.float32), meta, scale)
    return out.get(), ref


DECODE_CASES = [  # (block size, context lengths)
    (16, [1, 15, 16, 17, 31, 33, 100]),
    (8, [7, 8, 9, 64, 250]),
    (32, [1, 31, 32, 33, 500, 1000]),
    (5, [1, 4, 5, 6, 77]),  # not a power of two: the per-key table lookup path
    (1, [1, 2, 50]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size,contexts", DECODE_CASES)
@pytest.mark.parametrize("kernel", [None, "keysplit"])
def test_decode_attention_matches_reference(kernel, head_dim, group, block_size, contexts, dtype):
    """The launcher's choice (the 8-row "decode" tiles for every group here) and the 16-row key-split tiles."""
    rng = np.random.default_rng(hash((head_dim, group, block_size)) % 2**32)
    case = make_paged_case(rng, [(1, c) for c in contexts], block_size, 2, head_dim, group, dtype=dtype)
    out, ref = run_attention(case, kernel=kernel)
    assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kernel", [None, "decode"])
def test_forced_key_splits_merge_exactly(kernel, num_splits, head_dim, dtype):
    """12 rows in the longest query: the launcher's key-split tiles of 16, and decode tiles of 8 (two per query)."""
    rng = np.random.default_rng(num_splits)
    case = make_paged_case(rng, [(1, 700), (1, 5), (3, 300), (1, 64)], 16, 2, head_dim, 4, dtype=dtype)
    out, ref = run_attention(case, num_splits=num_splits, kernel=kernel)
    assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("num_seqs", [8, 16, 32, 48])
def test_decode_tiles_split_for_two_ctas_per_sm_and_other_kernels_for_four(num_seqs):
    """A decode step of num_seqs sequences (8 KV heads, 1,900 keys) plans its key splits for 2 CTAs per SM
    (the H200 sweep: more over-splits the decode tiles); the key-split kernel on the same step still for 4."""
    sms, hkv, keys = launchers._num_sms(), 8, 1900

    def planned(kernel):
        q_shape = (num_seqs, 4 * hkv, 128)
        plan = launchers._plan_attention(q_shape, (4000, 16, hkv, 128), (4000, 16, hkv, 128), (num_seqs, 119),
                                         num_seqs, num_seqs + 1, None, 1, keys, None, 0, kernel, "f16", False)
        return plan.num_splits

    def expected(ctas_per_sm):
        ctas = num_seqs * hkv
        if ctas >= ctas_per_sm * sms:
            return 1
        splits = min(math.ceil(ctas_per_sm * sms / ctas), math.ceil(keys / launchers.MIN_PARTITION))
        partition = math.ceil(keys / splits / launchers.KEYS_PER_ROUND) * launchers.KEYS_PER_ROUND
        return math.ceil(keys / partition)

    assert planned("decode") == expected(launchers.DECODE_SPLIT_CTAS_PER_SM)
    assert planned("keysplit") == expected(launchers.SPLIT_CTAS_PER_SM)
    if num_seqs * hkv < 2 * sms:  # (on a 132-SM H200: 8 and 16 sequences)
        assert planned("decode") < planned("keysplit")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kernel", [None, "rowsplit", "decode"])
def test_prefill_and_chunked_prefill_in_mixed_batches(kernel, head_dim, group, block_size, dtype):
    """Full prefills, chunks on top of a cached prefix, and decodes in one batch (the launcher's choice,
    attention.cu's row-split kernel, which the launcher now picks only for 64..127 rows, and its decode
    kernel, which must hold for queries of any length in tiles of 8 rows)."""
    rng = np.random.default_rng(block_size * 100 + group)
    seqs = [(37, 37), (1, 90), (16, 16), (20, 133), (1, 1), (70, 70), (5, block_size * 4 + 1)]
    case = make_paged_case(rng, seqs, block_size, 2, head_dim, group, dtype=dtype)
    out, ref = run_attention(case, kernel=kernel)
    assert_close(out, ref, TOL[dtype])
    out_split, _ = run_attention(case, num_splits=3, kernel=kernel)
    assert_close(out_split, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 8)])
def test_long_context_decode_32k(head_dim, group, dtype):
    rng = np.random.default_rng(32)
    case = make_paged_case(rng, [(1, 32768), (1, 20000 + 3)], 16, 1, head_dim, group, dtype=dtype)
    out, ref = run_attention(case)
    assert_close(out, ref, TOL[dtype])


def spare_block(case) -> int:
    """The one pool block no sequence's table uses (make_paged_case with spare_blocks=1): all NaN."""
    _, k_cache, _, tables, ctx, _ = case
    used = {int(b) for s, c in enumerate(ctx.tolist()) for b in tables[s, :-(-c // k_cache.shape[1])]}
    (spare,) = set(range(k_cache.shape[0])) - used
    assert np.isnan(k_cache[spare].astype(np.float32)).all()
    return spare


def free_blocks_before_windows(case, window, poisoned_block):
    """Point every block-table entry wholly before sequence s's first query's window at
    `poisoned_block` (all NaN): a sliding-window engine may have freed those blocks already, so a kernel
    must never read them. Returns the number of entries replaced."""
    q, k_cache, v_cache, tables, ctx, qsl = case
    block_size = k_cache.shape[1]
    replaced = 0
    for s, context_len in enumerate(ctx.tolist()):
        first_pos = context_len - int(qsl[s + 1] - qsl[s])
        first_key = max(0, first_pos - window + 1)  # the first query's window starts here
        dead = first_key // block_size  # blocks [0, dead) hold only keys before every window
        tables[s, :dead] = poisoned_block
        replaced += dead
    return replaced


WINDOW_DECODE_CASES = [  # (block size, window, context lengths)
    (16, 64, [1, 15, 63, 64, 65, 100, 700, 5000]),
    (16, 100, [99, 100, 101, 1000, 4097]),
    (8, 37, [1, 36, 37, 38, 250, 3000]),
    (32, 4096, [100, 4095, 4096, 4097, 9000]),
    (5, 23, [1, 22, 23, 24, 300]),  # not a power of two: the per-key table lookup path
    (16, 1, [1, 2, 300]),  # a window of one: each query sees only itself
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (64, 1)])
@pytest.mark.parametrize("block_size,window,contexts", WINDOW_DECODE_CASES)
@pytest.mark.parametrize("kernel", [None, "keysplit"])
def test_sliding_window_decode_matches_reference(kernel, block_size, window, contexts, head_dim, group, num_splits,
                                                  dtype):
    rng = np.random.default_rng(hash((block_size, window, head_dim, group)) % 2**32)
    case = make_paged_case(rng, [(1, c) for c in contexts], block_size, 2, head_dim, group, spare_blocks=1,
                           dtype=dtype)
    replaced = free_blocks_before_windows(case, window, spare_block(case))
    assert replaced > 0 or max(contexts) <= window
    out, ref = run_attention(case, num_splits=num_splits, window=window, kernel=kernel)
    assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size,window", [(16, 20), (8, 50), (32, 33), (16, 128)])
@pytest.mark.parametrize("kernel", [None, "rowsplit", "decode"])
def test_sliding_window_prefill_and_chunks_in_mixed_batches(kernel, head_dim, group, block_size, window, dtype):
    """Prefills longer than the window (ROW_SPLIT tiles whose rows have different window starts),
    chunks on top of a prefix longer than the window, decodes and short prefills, with and without
    forced splits; blocks before each sequence's first window are poisoned."""
    rng = np.random.default_rng(block_size * 1000 + window + group)
    seqs = [(150, 150), (1, 300), (16, 16), (40, 233), (1, 1), (70, 70), (5, block_size * 9 + 1), (200, 260)]
    case = make_paged_case(rng, seqs, block_size, 2, head_dim, group, spare_blocks=1, dtype=dtype)
    free_blocks_before_windows(case, window, spare_block(case))
    for num_splits in (None, 1, 2, 5):
        out, ref = run_attention(case, num_splits=num_splits, window=window, kernel=kernel)
        assert_close(out, ref, TOL[dtype])


def test_window_zero_means_no_window_and_negative_is_refused():
    rng = np.random.default_rng(9)
    case = make_paged_case(rng, [(1, 300), (30, 30)], 16, 2, 64, 2)
    out_default, ref = run_attention(case)
    out_zero, _ = run_attention(case, window=0)
    np.testing.assert_array_equal(out_zero, out_default)
    out_huge, _ = run_attention(case, window=10**6)  # wider than every context: the same attention
    assert_close(out_huge, ref, TOL[np.dtype(np.float16)])
    q, k, v, tables, ctx, qsl = (cupy.asarray(a) for a in case)
    with pytest.raises(ValueError, match="window must be"):
        launchers.paged_attention(q, k, v, tables, ctx, qsl, 30, 300, 0.125, window=-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_no_sequence_are_zero(dtype):
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, tables, ctx, qsl = make_paged_case(rng, [(2, 10)], 16, 1, 64, 2, dtype=dtype)
    q_padded = np.concatenate([q, rng.standard_normal((3,) + q.shape[1:]).astype(dtype)])
    out = launchers.paged_attention(cupy.asarray(q_padded), cupy.asarray(k_cache), cupy.asarray(v_cache),
                                    cupy.asarray(tables), cupy.asarray(ctx), cupy.asarray(qsl), 2, 10, 0.125).get()
    out = out.astype(np.float32)
    assert np.abs(out[:2]).max() > 0
    assert np.all(out[2:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_no_zero_fill_when_every_row_is_queried(head_dim, dtype):
    """zero_fill=False (the decode graphs): the kernel itself writes every row, bit for bit the zero-filled
    result, even where the memory pool hands back a buffer full of NaN."""
    rng = np.random.default_rng(6)
    case = make_paged_case(rng, [(1, c) for c in (1, 17, 300, 64, 1000)], 16, 2, head_dim, 4, dtype=dtype)
    args = [cupy.asarray(a) for a in case]
    filled = launchers.paged_attention(*args, 1, 1000, 0.125)
    garbage = cupy.full(filled.shape, np.nan, dtype=filled.dtype)  # freed below: the pool reuses it
    del garbage
    unfilled = launchers.paged_attention(*args, 1, 1000, 0.125, zero_fill=False)
    assert np.abs(filled.get().astype(np.float32)).max() > 0
    np.testing.assert_array_equal(unfilled.get().view(np.uint16), filled.get().view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_strided_rows_and_skips_negative_slots(dtype):
    rng = np.random.default_rng(0)
    num_tokens, hkv, d = 50, 3, 64
    qkv = cupy.asarray(rng.standard_normal((num_tokens, (9 + 2 * hkv) * d)).astype(dtype))
    k = qkv[:, 9 * d:(9 + hkv) * d].reshape(num_tokens, hkv, d)  # strided views, as the model makes them
    v = qkv[:, (9 + hkv) * d:].reshape(num_tokens, hkv, d)
    slots = rng.permutation(40 * 16)[:num_tokens].astype(np.int32)
    slots[[3, 17, 49]] = -1
    k_cache = cupy.asarray(rng.standard_normal((40, 16, hkv, d)).astype(dtype))
    v_cache = cupy.asarray(rng.standard_normal((40, 16, hkv, d)).astype(dtype))
    k_ref, v_ref = k_cache.get(), v_cache.get()
    write_kv_reference(np, k.get(), v.get(), k_ref, v_ref, slots)
    launchers.write_kv(k, v, k_cache, v_cache, cupy.asarray(slots))
    assert k_cache.dtype == dtype
    np.testing.assert_array_equal(k_cache.get().view(np.uint16), k_ref.view(np.uint16))  # bit for bit
    np.testing.assert_array_equal(v_cache.get().view(np.uint16), v_ref.view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_every_layer_k_and_v(dtype):
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((3, 2, 20, 16, 2, 64)).astype(dtype)
    src, dst = np.array([0, 5, 5, 19], np.int32), np.array([1, 2, 7, 11], np.int32)
    expected = kv.copy()
    NumpyOps().copy_blocks(expected, src, dst)
    kv_gpu = cupy.asarray(kv)
    launchers.copy_blocks(kv_gpu, cupy.asarray(src), cupy.asarray(dst))
    np.testing.assert_array_equal(kv_gpu.get().view(np.uint16), expected.view(np.uint16))


def on_gpu(host, offset: int = 0):
    """A contiguous cupy copy of `host`; offset > 0 places it that many elements past a 16-byte boundary,
    which sends layer.cu's kernels down their scalar path even for widths that are multiples of 8."""
    if not offset:
        return cupy.asarray(host)
    flat = cupy.empty(host.size + offset, dtype=host.dtype)
    view = flat[offset:].reshape(host.shape)
    view[...] = cupy.asarray(host)
    assert view.flags.c_contiguous and view.data.ptr % 16 != 0
    return view


# Hidden sizes: 2048 / 576 (SmolLM2) / 896 take the 16-byte path, 100 and 50 the scalar one, 40960 the
# vector path past the chunks a 1024-thread block keeps in registers (read back from residual_out).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden,offset", [(576, 0), (896, 0), (2048, 0), (100, 0), (50, 0), (40960, 0),
                                           (2048, 1)])
def test_rms_norm_matches_numpy_ops(with_residual, hidden, offset, dtype):
    rng = np.random.default_rng(hidden)
    x = (3 * rng.standard_normal((33, hidden))).astype(dtype)
    residual = rng.standard_normal((33, hidden)).astype(dtype) if with_residual else None
    weight = (1 + 0.2 * rng.standard_normal(hidden)).astype(dtype)
    ref_out, ref_res = NumpyOps().rms_norm(x.astype(np.float32), weight.astype(np.float32), 1e-5,
                                           None if residual is None else residual.astype(np.float32))
    out, res = launchers.rms_norm(on_gpu(x, offset), cupy.asarray(weight), 1e-5,
                                  None if residual is None else cupy.asarray(residual))
    assert out.dtype == res.dtype == dtype
    assert_close(out.get(), ref_out, TOL[dtype])
    assert_close(res.get(), ref_res, TOL[dtype])
    if with_residual:  # the new residual is the exact sum rounded once to the dtype
        exact = round_once(x.astype(np.float64) + residual.astype(np.float64), dtype)
        np.testing.assert_array_equal(res.get().view(np.uint16), exact.view(np.uint16))
    else:
        np.testing.assert_array_equal(res.get().view(np.uint16), x.view(np.uint16))
    # every output rounded once from fp32: only the sum-of-squares order may differ from the reference
    inv_rms = 1 / np.sqrt(np.mean(np.square(res.get().astype(np.float64)), axis=1, keepdims=True) + 1e-5)
    expected = round_once(res.get().astype(np.float64) * inv_rms * weight.astype(np.float64), dtype)
    ulps = np.abs(out.get().view(np.int16).astype(np.int32) - expected.view(np.int16).astype(np.int32))
    assert ulps.max() <= 1, f"rms_norm output {ulps.max()} ulps from h * inv_rms * weight rounded once"


@pytest.mark.parametrize("dtype", DTYPES)
# D % 8 == 0: the vector path, else the scalar one; 40 + 8 heads: each warp of the block takes several.
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(128, 16, 8), (128, 40, 8), (64, 9, 3), (72, 9, 3),
                                                             (36, 16, 8)])
def test_head_rms_norm_matches_numpy_ops_on_strided_views(head_dim, num_heads, num_kv_heads, dtype):
    rng = np.random.default_rng(head_dim + num_heads)
    num_tokens = 23
    # Heads of very different scales: a mix-up of one head's sum with another's shows in the output.
    scales = np.exp(rng.uniform(-3, 3, num_heads + 2 * num_kv_heads)).repeat(head_dim)
    qkv = (rng.standard_normal((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)) * scales).astype(dtype)
    q_weight, k_weight = ((1 + 0.3 * rng.standard_normal(head_dim)).astype(dtype) for _ in range(2))
    q_host, k_host, _ = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q_ref, k_ref = NumpyOps().head_rms_norm(q_host.astype(np.float32), k_host.astype(np.float32),
                                            q_weight.astype(np.float32), k_weight.astype(np.float32), 1e-6)
    q, k, _ = split_qkv(cupy.asarray(qkv), num_heads, num_kv_heads, head_dim)
    q_out, k_out = launchers.head_rms_norm(q, k, cupy.asarray(q_weight), cupy.asarray(k_weight), 1e-6)
    assert q_out.dtype == k_out.dtype == dtype and q_out.flags.c_contiguous and k_out.flags.c_contiguous
    for out, ref, src, weight in ((q_out, q_ref, q_host, q_weight), (k_out, k_ref, k_host, k_weight)):
        assert out.shape == src.shape
        # per head, relative to the head's own largest value (heads span six orders of magnitude)
        for head in range(src.shape[1]):
            assert_close(out[:, head].get(), ref[:, head], TOL[dtype])
        # every output rounded once from fp32: only the sum-of-squares order may differ
        x = src.astype(np.float64)
        inv_rms = 1 / np.sqrt(np.mean(np.square(x), axis=2, keepdims=True) + 1e-6)
        expected = round_once(x * inv_rms * weight.astype(np.float64), dtype)
        ulps = np.abs(out.get().view(np.int16).astype(np.int32) - expected.view(np.int16).astype(np.int32))
        assert ulps.max() <= 1, f"head_rms_norm output {ulps.max()} ulps from x * inv_rms * weight rounded once"


def test_head_rms_norm_refuses_mismatched_weights():
    q = cupy.ones((2, 4, 64), dtype=np.float16)
    k = cupy.ones((2, 2, 64), dtype=np.float16)
    with pytest.raises(ValueError, match="k_weight has 32 entries for head dim 64"):
        launchers.head_rms_norm(q, k, cupy.ones(64, np.float16), cupy.ones(32, np.float16), 1e-6)
    with pytest.raises(ValueError, match="q_weight must be"):
        launchers.head_rms_norm(q, k, cupy.ones(64, np.float32), cupy.ones(64, np.float16), 1e-6)


def round_once(values, dtype):
    """float64 -> dtype with one round-to-nearest-even (ml_dtypes goes through float32 for bfloat16,
    which rounds twice)."""
    if dtype != BF16:
        return values.astype(dtype)
    mantissa, exponent = np.frexp(values)  # values = mantissa * 2^exponent, 0.5 <= |mantissa| < 1
    return np.ldexp(np.rint(mantissa * 256) / 256, exponent).astype(dtype)  # 8 significant bits: exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_kind", ["same", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 72, 24])  # D/2 % 8 == 0: vector path; 36, 12: scalar
def test_rope_matches_numpy_ops_on_strided_views(cache_kind, head_dim, dtype):
    from offline_paged.models.config import LlamaConfig
    from offline_paged.models.rope import cos_sin_cache

    rng = np.random.default_rng(head_dim)
    config = LlamaConfig(vocab_size=10, hidden_size=9 * head_dim, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=head_dim, rope_theta=1e5,
                         max_position_embeddings=4096)
    table = cos_sin_cache(config, dtype if cache_kind == "same" else np.float32)
    num_tokens = 21
    qkv = rng.standard_normal((num_tokens, 15 * head_dim)).astype(dtype)
    positions = rng.integers(0, 4096, num_tokens).astype(np.int32)
    q_host = qkv[:, :9 * head_dim].reshape(num_tokens, 9, head_dim)
    k_host = qkv[:, 9 * head_dim:12 * head_dim].reshape(num_tokens, 3, head_dim)
    q_ref, k_ref = NumpyOps().rope(q_host.astype(np.float32), k_host.astype(np.float32), positions,
                                   table.astype(np.float32))
    qkv_gpu = cupy.asarray(qkv)
    q = qkv_gpu[:, :9 * head_dim].reshape(num_tokens, 9, head_dim)
    k = qkv_gpu[:, 9 * head_dim:12 * head_dim].reshape(num_tokens, 3, head_dim)
    q_out, k_out = launchers.rope(q, k, cupy.asarray(positions), cupy.asarray(table))
    assert q_out.dtype == k_out.dtype == dtype
    assert_close(q_out.get(), q_ref, TOL[dtype])
    assert_close(k_out.get(), k_ref, TOL[dtype])


def rope_write_kv_case(rng, num_tokens, head_dim, dtype, cache_kind, num_heads=9, num_kv_heads=3):
    """(qkv [T, (H + 2Hkv) D] on the GPU, positions, cos_sin table, slots, k_cache, v_cache [N, B, Hkv, D] host)
    with random values everywhere. Every 5th token from the 4th on has slot -1; the others draw distinct
    slots from 1.., so cache row 0 is never a target (a -1 read as a row would land there)."""
    from offline_paged.models.config import LlamaConfig
    from offline_paged.models.rope import cos_sin_cache

    config = LlamaConfig(vocab_size=10, hidden_size=num_heads * head_dim, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                         rope_theta=1e5, max_position_embeddings=4096)
    table = cos_sin_cache(config, dtype if cache_kind == "same" else np.float32)
    qkv = cupy.asarray(rng.standard_normal((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)).astype(dtype))
    positions = rng.integers(1, 4096, num_tokens).astype(np.int32)
    num_blocks, block_size = -(-(num_tokens + 1) // 16) + 2, 16
    slots = (1 + rng.permutation(num_blocks * block_size - 1)[:num_tokens]).astype(np.int32)
    slots[3::5] = -1
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (rng.standard_normal(cache_shape).astype(dtype) for _ in range(2))
    return qkv, positions, table, slots, k_cache, v_cache


def split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    """The strided [T, heads, D] views of q, k and v that Llama._attention cuts from the fused projection."""
    num_tokens, q_dim, kv_dim = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_dim].reshape(num_tokens, num_heads, head_dim),
            qkv[:, q_dim:q_dim + kv_dim].reshape(num_tokens, num_kv_heads, head_dim),
            qkv[:, q_dim + kv_dim:].reshape(num_tokens, num_kv_heads, head_dim))


def bits(a):
    return cupy.asnumpy(a).view(np.uint16)


# Head dims 64, 128: the vector path; 72 (D/2 = 36): the scalar path. "contiguous": q and k new arrays and
# v a view (what Qwen3's per-head q/k norm leaves), else all three views into the fused qkv rows.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_kind", ["same", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128, 72])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("layout", ["views", "contiguous"])
def test_rope_write_kv_equals_rope_then_write_kv_bit_for_bit(layout, num_tokens, head_dim, cache_kind, dtype):
    rng = np.random.default_rng([num_tokens, head_dim])
    num_heads, num_kv_heads = 9, 3
    qkv, positions, table, slots, k_host, v_host = rope_write_kv_case(rng, num_tokens, head_dim, dtype, cache_kind)
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if layout == "contiguous":
        q, k = cupy.ascontiguousarray(q), cupy.ascontiguousarray(k)
    table_gpu, positions_gpu, slots_gpu = cupy.asarray(table), cupy.asarray(positions), cupy.asarray(slots)
    qkv_before = bits(qkv)

    q_want, k_rotated = launchers.rope(q, k, positions_gpu, table_gpu)  # the two-kernel path
    k_want, v_want = cupy.asarray(k_host), cupy.asarray(v_host)
    launchers.write_kv(k_rotated, v, k_want, v_want, slots_gpu)
    k_got, v_got = cupy.asarray(k_host), cupy.asarray(v_host)
    q_got = launchers.rope_write_kv(q, k, v, positions_gpu, table_gpu, k_got, v_got, slots_gpu)

    assert q_got.dtype == dtype and q_got.shape == q.shape and q_got.flags.c_contiguous
    np.testing.assert_array_equal(bits(q_got), bits(q_want))
    np.testing.assert_array_equal(bits(k_got), bits(k_want))
    np.testing.assert_array_equal(bits(v_got), bits(v_want))
    np.testing.assert_array_equal(bits(qkv), qkv_before)  # the inputs are left alone
    # Rows no token targets (row 0 and those of the -1 slots among them) keep the random fill.
    untouched = np.setdiff1d(np.arange(k_host.shape[0] * k_host.shape[1]), slots[slots >= 0])
    rows = lambda a: a.reshape(-1, num_kv_heads, head_dim)  # noqa: E731
    np.testing.assert_array_equal(rows(bits(k_got))[untouched], rows(k_host.view(np.uint16))[untouched])
    np.testing.assert_array_equal(rows(bits(v_got))[untouched], rows(v_host.view(np.uint16))[untouched])

    # Against the NumPy reference in fp32 (same rounded inputs): rotated within fp16/bf16 rounding, v exact.
    k_ref, v_ref = k_host.astype(np.float32), v_host.astype(np.float32)
    f32 = lambda a: cupy.asnumpy(a).astype(np.float32)  # noqa: E731
    q_ref = NumpyOps().rope_write_kv(f32(q), f32(k), f32(v), positions, table.astype(np.float32), k_ref, v_ref,
                                     slots)
    assert_close(q_got.get(), q_ref, TOL[dtype])
    assert_close(k_got.get(), k_ref, TOL[dtype])
    np.testing.assert_array_equal(v_got.get().astype(np.float32), v_ref)


def test_rope_write_kv_refuses_bad_input():
    rng = np.random.default_rng(7)
    qkv, positions, table, slots, k_host, v_host = rope_write_kv_case(rng, 7, 64, np.float16, "float32")
    q, k, v = split_qkv(qkv, 9, 3, 64)
    args = dict(q=q, k=k, v=v, positions=cupy.asarray(positions), cos_sin=cupy.asarray(table),
                k_cache=cupy.asarray(k_host), v_cache=cupy.asarray(v_host), slot_mapping=cupy.asarray(slots))
    refusals = [
        (dict(q=q.astype(cupy.float32)), "q must be float16 or bfloat16, got float32"),
        (dict(v=cupy.asarray(cupy.asnumpy(v).astype(BF16))), "v must be float16, got bfloat16"),
        (dict(k_cache=cupy.asarray(k_host.astype(BF16))), "k_cache must be float16, got bfloat16"),
        (dict(cos_sin=cupy.asarray(table, dtype=cupy.float64)), "cos_sin_cache must be a contiguous 2-D"),
        (dict(slot_mapping=args["slot_mapping"].astype(cupy.int64)), "slot_mapping must be int32"),
        (dict(positions=args["positions"][:6]), "6 positions for 7 tokens"),
        (dict(slot_mapping=args["slot_mapping"][:6]), "slot_mapping has 6 slots for 7 tokens"),
        (dict(v=v[:, :2]), r"k shape \(7, 3, 64\) != v shape \(7, 2, 64\)"),
        (dict(k=k[:5], v=v[:5]), r"k shape \(5, 3, 64\) does not fit q shape \(7, 9, 64\)"),
        (dict(v_cache=cupy.asarray(np.ascontiguousarray(v_host[:, :8]))),
         r"k_cache shape \(\d+, 16, 3, 64\) != v_cache shape"),
        (dict(k_cache=cupy.asarray(np.ascontiguousarray(k_host[..., :32])),
              v_cache=cupy.asarray(np.ascontiguousarray(v_host[..., :32]))),
         r"k rows \(3, 64\) do not match cache rows \(3, 32\)"),
        (dict(v_cache=args["v_cache"][:, ::2]), "v_cache must be C-contiguous"),
    ]
    for change, message in refusals:
        with pytest.raises(ValueError, match=message):
            launchers.rope_write_kv(**(args | change))
    k_cache_before = bits(args["k_cache"])
    launchers.rope_write_kv(**args)  # the unchanged arguments are accepted
    assert (bits(args["k_cache"]) != k_cache_before).any()


# 1536 / 8192 columns: vector path; 50 / 1540: scalar; offset 1: unaligned, so scalar; 70000 rows: more
# than gridDim.y holds, so the kernel's row loop strides.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inter,offset", [(17, 1536, 0), (256, 8192, 0), (17, 50, 0), (5, 1540, 0),
                                                     (17, 1536, 1), (70000, 16, 0), (70000, 5, 0)])
def test_silu_mul_matches_numpy_ops(num_tokens, inter, offset, dtype):
    rng = np.random.default_rng(inter)
    gate_up = (4 * rng.standard_normal((num_tokens, 2 * inter))).astype(dtype)
    ref = NumpyOps().silu_mul(gate_up.astype(np.float32))
    out = launchers.silu_mul(on_gpu(gate_up, offset))
    assert out.dtype == dtype
    assert_close(out.get(), ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_launch_order_changes_nothing_but_the_order(head_dim, num_splits, dtype):
    """A launch order (a random permutation, or the device's longest-first one) gives bit for bit the result
    of index order, for decode rows and for a mixed prefill/decode batch (the row-split kernel)."""
    from offline_paged.ops import step_inputs_launcher

    rng = np.random.default_rng(head_dim + (num_splits or 0))
    for seqs in ([(1, c) for c in (300, 1, 17, 1000, 64, 65, 2, 999)],
                 [(37, 37), (1, 90), (20, 133), (1, 1), (70, 70)]):
        case = make_paged_case(rng, seqs, 16, 2, head_dim, 4, dtype=dtype)
        args = [cupy.asarray(a) for a in case]
        max_q, max_ctx = max(q for q, _ in seqs), max(c for _, c in seqs)
        plain = launchers.paged_attention(*args, max_q, max_ctx, 0.125, num_splits=num_splits).get()
        assert np.abs(plain.astype(np.float32)).max() > 0
        longest_first = cupy.empty(len(seqs), dtype=cupy.int32)
        step_inputs_launcher.launch_order(args[4], longest_first)
        for order in (cupy.asarray(rng.permutation(len(seqs)).astype(np.int32)), longest_first):
            ordered = launchers.paged_attention(*args, max_q, max_ctx, 0.125, num_splits=num_splits,
                                                launch_order=order).get()
            np.testing.assert_array_equal(ordered.view(np.uint16), plain.view(np.uint16))
    case = make_paged_case(rng, [(1, 5)] * 8, 16, 2, head_dim, 4, dtype=dtype)
    with pytest.raises(ValueError, match="launch_order must have 8 entries"):
        launchers.paged_attention(*[cupy.asarray(a) for a in case], 1, 5, 0.125,
                                  launch_order=cupy.arange(7, dtype=cupy.int32))


def test_launchers_say_what_is_wrong():
    q = cupy.zeros((4, 8, 64), dtype=cupy.float32)
    cache = cupy.zeros((4, 16, 2, 64), dtype=cupy.float16)
    ints = cupy.zeros((1, 1), dtype=cupy.int32)
    one = cupy.zeros(1, dtype=cupy.int32)
    with pytest.raises(ValueError, match="q must be float16 or bfloat16"):
        launchers.paged_attention(q, cache, cache, ints, one, cupy.zeros(2, dtype=cupy.int32), 1, 1, 1.0)
    with pytest.raises(ValueError, match="k_cache must be bfloat16, got float16"):  # mixed element types
        launchers.paged_attention(cupy.zeros((4, 8, 64), BF16), cache, cache, ints, one,
                                  cupy.zeros(2, dtype=cupy.int32), 1, 1, 1.0)
    with pytest.raises(ValueError, match="head dim 96 not supported"):
        c96 = cupy.zeros((4, 16, 2, 96), dtype=cupy.float16)
        launchers.paged_attention(cupy.zeros((4, 8, 96), cupy.float16), c96, c96, ints, one,
                                  cupy.zeros(2, dtype=cupy.int32), 1, 1, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        launchers.silu_mul(cupy.zeros((8, 4), cupy.float16).T)
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        launchers.write_kv(cache[0], cache[0], cache, cache, cupy.zeros(16, dtype=cupy.int64))
    with pytest.raises(ValueError, match="weight must be bfloat16"):
        launchers.rms_norm(cupy.zeros((2, 64), BF16), cupy.zeros(64, cupy.float16), 1e-5)
