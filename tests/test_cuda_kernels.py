"""Every CUDA kernel against the NumPy reference on random inputs (fp16 tolerances). Needs a GPU.

Attention cases cover shuffled block tables, context lengths 1 / block boundary +-1 / not multiples of
the block size / up to 32k, block sizes 8, 16, 32, GQA ratios 1, 3, 4, 8, head dims 64 and 128,
decode, prefill, chunked prefill and mixed batches, and forced split counts. The cache is filled with
NaN wherever no token lives, so a kernel that reads past a context (or a padding block) fails loudly.
"""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.attention import paged_attention_reference, write_kv_reference
from offline_paged.models.ops_numpy import NumpyOps

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from offline_paged.cuda import launchers  # noqa: E402  (needs cupy)


def assert_close(actual, expected, rel=1e-2):
    """fp16 tolerance relative to the largest reference magnitude (outputs of long softmaxes are small)."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert np.isfinite(actual).all(), "kernel output has NaN/inf"
    scale = max(np.abs(expected).max(), 1e-6)
    err = np.abs(actual - expected).max()
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} * max|ref| {scale:.3g}"


def make_paged_case(rng, seqs, block_size, num_kv_heads, head_dim, group, spare_blocks=3):
    """seqs: [(q_len, context_len)]. Returns host arrays (q, k_cache, v_cache, tables, ctx, qsl) where
    every slot that holds no token is NaN and block tables are a shuffled draw from the pool."""
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = rng.permutation(num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = np.full(shape, np.nan, dtype=np.float16)
    v_cache = np.full(shape, np.nan, dtype=np.float16)
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
    q = (1.5 * rng.standard_normal((int(qsl[-1]), num_kv_heads * group, head_dim))).astype(np.float16)
    ctx = np.array([c for _, c in seqs], dtype=np.int32)
    return q, k_cache, v_cache, tables, ctx, qsl


def run_attention(case, num_splits=None):
    from offline_paged.models.attention import AttentionMetadata

    q, k_cache, v_cache, tables, ctx, qsl = case
    scale = q.shape[2] ** -0.5
    q_lens = np.diff(qsl)
    out = launchers.paged_attention(
        cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache), cupy.asarray(tables), cupy.asarray(ctx),
        cupy.asarray(qsl), int(q_lens.max()), int(ctx.max()), scale, num_splits=num_splits).get()
    # The reference multiplies NaN-free gathers only, so NaN slots never reach it.
    meta = AttentionMetadata(np.zeros(len(q), np.int32), tables, ctx, qsl, int(q_lens.max()), int(ctx.max()))
    ref = paged_attention_reference(np, q.astype(np.float32), k_cache.astype(np.float32),
                                    v_cache.astype(np.float32), meta, scale)
    return out, ref


DECODE_CASES = [  # (block size, context lengths)
    (16, [1, 15, 16, 17, 31, 33, 100]),
    (8, [7, 8, 9, 64, 250]),
    (32, [1, 31, 32, 33, 500, 1000]),
    (5, [1, 4, 5, 6, 77]),  # not a power of two: the per-key table lookup path
    (1, [1, 2, 50]),
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size,contexts", DECODE_CASES)
def test_decode_attention_matches_reference(head_dim, group, block_size, contexts):
    rng = np.random.default_rng(hash((head_dim, group, block_size)) % 2**32)
    case = make_paged_case(rng, [(1, c) for c in contexts], block_size, 2, head_dim, group)
    out, ref = run_attention(case)
    assert_close(out, ref)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forced_key_splits_merge_exactly(num_splits, head_dim):
    rng = np.random.default_rng(num_splits)
    case = make_paged_case(rng, [(1, 700), (1, 5), (3, 300), (1, 64)], 16, 2, head_dim, 4)
    out, ref = run_attention(case, num_splits=num_splits)
    assert_close(out, ref)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_and_chunked_prefill_in_mixed_batches(head_dim, group, block_size):
    """Full prefills, chunks on top of a cached prefix, and decodes in one batch."""
    rng = np.random.default_rng(block_size * 100 + group)
    seqs = [(37, 37), (1, 90), (16, 16), (20, 133), (1, 1), (70, 70), (5, block_size * 4 + 1)]
    case = make_paged_case(rng, seqs, block_size, 2, head_dim, group)
    out, ref = run_attention(case)
    assert_close(out, ref)
    out_split, _ = run_attention(case, num_splits=3)
    assert_close(out_split, ref)


@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 8)])
def test_long_context_decode_32k(head_dim, group):
    rng = np.random.default_rng(32)
    case = make_paged_case(rng, [(1, 32768), (1, 20000 + 3)], 16, 1, head_dim, group)
    out, ref = run_attention(case)
    assert_close(out, ref)


def test_rows_of_no_sequence_are_zero():
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, tables, ctx, qsl = make_paged_case(rng, [(2, 10)], 16, 1, 64, 2)
    q_padded = np.concatenate([q, rng.standard_normal((3,) + q.shape[1:]).astype(np.float16)])
    out = launchers.paged_attention(cupy.asarray(q_padded), cupy.asarray(k_cache), cupy.asarray(v_cache),
                                    cupy.asarray(tables), cupy.asarray(ctx), cupy.asarray(qsl), 2, 10, 0.125).get()
    assert np.abs(out[:2]).max() > 0
    assert np.all(out[2:] == 0)


def test_write_kv_scatters_strided_rows_and_skips_negative_slots():
    rng = np.random.default_rng(0)
    num_tokens, hkv, d = 50, 3, 64
    qkv = cupy.asarray(rng.standard_normal((num_tokens, (9 + 2 * hkv) * d)).astype(np.float16))
    k = qkv[:, 9 * d:(9 + hkv) * d].reshape(num_tokens, hkv, d)  # strided views, as the model makes them
    v = qkv[:, (9 + hkv) * d:].reshape(num_tokens, hkv, d)
    slots = rng.permutation(40 * 16)[:num_tokens].astype(np.int32)
    slots[[3, 17, 49]] = -1
    k_cache = cupy.asarray(rng.standard_normal((40, 16, hkv, d)).astype(np.float16))
    v_cache = cupy.asarray(rng.standard_normal((40, 16, hkv, d)).astype(np.float16))
    k_ref, v_ref = k_cache.get(), v_cache.get()
    write_kv_reference(np, k.get(), v.get(), k_ref, v_ref, slots)
    launchers.write_kv(k, v, k_cache, v_cache, cupy.asarray(slots))
    np.testing.assert_array_equal(k_cache.get(), k_ref)
    np.testing.assert_array_equal(v_cache.get(), v_ref)


def test_copy_blocks_copies_every_layer_k_and_v():
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((3, 2, 20, 16, 2, 64)).astype(np.float16)
    src, dst = np.array([0, 5, 5, 19], np.int32), np.array([1, 2, 7, 11], np.int32)
    expected = kv.copy()
    NumpyOps().copy_blocks(expected, src, dst)
    kv_gpu = cupy.asarray(kv)
    launchers.copy_blocks(kv_gpu, cupy.asarray(src), cupy.asarray(dst))
    np.testing.assert_array_equal(kv_gpu.get(), expected)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [576, 2048, 100])
def test_rms_norm_matches_numpy_ops(with_residual, hidden):
    rng = np.random.default_rng(hidden)
    x = (3 * rng.standard_normal((33, hidden))).astype(np.float16)
    residual = rng.standard_normal((33, hidden)).astype(np.float16) if with_residual else None
    weight = (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float16)
    ref_out, ref_res = NumpyOps().rms_norm(x.astype(np.float32), weight.astype(np.float32), 1e-5,
                                           None if residual is None else residual.astype(np.float32))
    out, res = launchers.rms_norm(cupy.asarray(x), cupy.asarray(weight), 1e-5,
                                  None if residual is None else cupy.asarray(residual))
    assert_close(out.get(), ref_out)
    assert_close(res.get(), ref_res)


@pytest.mark.parametrize("cache_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_matches_numpy_ops_on_strided_views(cache_dtype, head_dim):
    from offline_paged.models.config import LlamaConfig
    from offline_paged.models.rope import cos_sin_cache

    rng = np.random.default_rng(head_dim)
    config = LlamaConfig(vocab_size=10, hidden_size=9 * head_dim, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=head_dim, rope_theta=1e5,
                         max_position_embeddings=4096)
    table = cos_sin_cache(config, cache_dtype)
    num_tokens = 21
    qkv = rng.standard_normal((num_tokens, 15 * head_dim)).astype(np.float16)
    positions = rng.integers(0, 4096, num_tokens).astype(np.int32)
    q_host = qkv[:, :9 * head_dim].reshape(num_tokens, 9, head_dim)
    k_host = qkv[:, 9 * head_dim:12 * head_dim].reshape(num_tokens, 3, head_dim)
    q_ref, k_ref = NumpyOps().rope(q_host.astype(np.float32), k_host.astype(np.float32), positions,
                                   table.astype(np.float32))
    qkv_gpu = cupy.asarray(qkv)
    q = qkv_gpu[:, :9 * head_dim].reshape(num_tokens, 9, head_dim)
    k = qkv_gpu[:, 9 * head_dim:12 * head_dim].reshape(num_tokens, 3, head_dim)
    q_out, k_out = launchers.rope(q, k, cupy.asarray(positions), cupy.asarray(table))
    assert_close(q_out.get(), q_ref)
    assert_close(k_out.get(), k_ref)


def test_silu_mul_matches_numpy_ops():
    rng = np.random.default_rng(2)
    gate_up = (4 * rng.standard_normal((17, 2 * 1536))).astype(np.float16)
    ref = NumpyOps().silu_mul(gate_up.astype(np.float32))
    assert_close(launchers.silu_mul(cupy.asarray(gate_up)).get(), ref)


def test_launchers_say_what_is_wrong():
    q = cupy.zeros((4, 8, 64), dtype=cupy.float32)
    cache = cupy.zeros((4, 16, 2, 64), dtype=cupy.float16)
    ints = cupy.zeros((1, 1), dtype=cupy.int32)
    one = cupy.zeros(1, dtype=cupy.int32)
    with pytest.raises(ValueError, match="q must be float16"):
        launchers.paged_attention(q, cache, cache, ints, one, cupy.zeros(2, dtype=cupy.int32), 1, 1, 1.0)
    with pytest.raises(ValueError, match="head dim 96 not supported"):
        c96 = cupy.zeros((4, 16, 2, 96), dtype=cupy.float16)
        launchers.paged_attention(cupy.zeros((4, 8, 96), cupy.float16), c96, c96, ints, one,
                                  cupy.zeros(2, dtype=cupy.int32), 1, 1, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        launchers.silu_mul(cupy.zeros((8, 4), cupy.float16).T)
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        launchers.write_kv(cache[0], cache[0], cache, cache, cupy.zeros(16, dtype=cupy.int64))


def test_swap_out_and_in_round_trip_through_pinned_memory():
    from offline_paged.cuda.swap import BlockSwapper

    rng = np.random.default_rng(3)
    kv = cupy.asarray(rng.standard_normal((2, 2, 12, 16, 2, 64)).astype(np.float16))
    original = kv.get()
    swapper = BlockSwapper(kv, num_cpu_blocks=6)
    swapper.swap_out([3, 7, 11], [5, 0, 2])
    np.testing.assert_array_equal(swapper.cpu_cache[:, :, [5, 0, 2]], original[:, :, [3, 7, 11]])
    kv[:, :, [3, 7, 11]] = 0
    swapper.swap_in([5, 0, 2], [3, 7, 11])
    np.testing.assert_array_equal(kv.get(), original)
