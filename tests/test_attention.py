"""Paged attention: reference == dense attention, fast path == reference, KV writes and block copies."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.simple_runner import build_metadata
from offline_paged.ops.attention import dense_causal_attention, paged_attention_reference, write_kv_reference
from offline_paged.ops.attention_fast import paged_attention_fast
from offline_paged.ops.ops_numpy import NumpyOps

H, HKV, D = 6, 2, 8


def _scatter_sequences(rng, lengths, block_size, num_blocks, dtype):
    """Random K/V for each sequence written into a shuffled pool; returns (k_cache, v_cache, tables, ks, vs)."""
    k_cache = rng.standard_normal((num_blocks, block_size, HKV, D)).astype(dtype)  # [N, B, Hkv, D] (garbage)
    v_cache = rng.standard_normal((num_blocks, block_size, HKV, D)).astype(dtype)  # [N, B, Hkv, D]
    free = list(rng.permutation(num_blocks))
    tables, ks, vs = [], [], []
    for length in lengths:
        table = [int(free.pop()) for _ in range(-(-length // block_size))]
        k = rng.standard_normal((length, HKV, D)).astype(dtype)  # [L, Hkv, D]
        v = rng.standard_normal((length, HKV, D)).astype(dtype)  # [L, Hkv, D]
        slots = np.array([table[p // block_size] * block_size + p % block_size for p in range(length)])
        write_kv_reference(np, k, v, k_cache, v_cache, slots)
        tables.append(table), ks.append(k), vs.append(v)
    return k_cache, v_cache, tables, ks, vs


def _case(seed, lengths, query_lens, block_size, dtype=np.float32):
    rng = np.random.default_rng(seed)
    k_cache, v_cache, tables, ks, vs = _scatter_sequences(rng, lengths, block_size, 64, dtype)
    q = rng.standard_normal((sum(query_lens), H, D)).astype(dtype)  # [T, H, D]
    meta = build_metadata(np, tables, lengths, query_lens, slot_mapping=[-1] * sum(query_lens))
    return q, k_cache, v_cache, meta, ks, vs


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_equals_dense(block_size):
    lengths = [5, 17, 1, 32]
    q, k_cache, v_cache, meta, ks, vs = _case(0, lengths, lengths, block_size)
    out = paged_attention_reference(np, q, k_cache, v_cache, meta, 0.3)  # [T, H, D]
    start = 0
    for length, k, v in zip(lengths, ks, vs):
        dense = dense_causal_attention(np, q[start:start + length], k, v, 0.3)
        np.testing.assert_allclose(out[start:start + length], dense, atol=1e-6, rtol=0)
        start += length


def test_chunk_attends_to_prefix_like_the_tail_of_dense():
    """A 4-query chunk at the end of a 20-token context equals the last 4 rows of dense attention."""
    q, k_cache, v_cache, meta, ks, vs = _case(1, [20], [4], block_size=3)
    rng = np.random.default_rng(9)
    full_q = rng.standard_normal((20, H, D)).astype(np.float32)  # [L, H, D]
    full_q[-4:] = q
    dense = dense_causal_attention(np, full_q, ks[0], vs[0], 0.25)
    out = paged_attention_reference(np, q, k_cache, v_cache, meta, 0.25)
    np.testing.assert_allclose(out, dense[-4:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("seed", range(6))
def test_fast_path_equals_reference_on_mixed_batches(seed, dtype, tol):
    rng = np.random.default_rng(100 + seed)
    num_seqs = int(rng.integers(1, 7))
    lengths = rng.integers(1, 40, size=num_seqs).tolist()
    query_lens = [int(rng.integers(1, n + 1)) if rng.random() < 0.4 else 1 for n in lengths]
    block_size = int(rng.choice([1, 3, 16]))
    q, k_cache, v_cache, meta, _, _ = _case(seed, lengths, query_lens, block_size, dtype)
    want = paged_attention_reference(np, q, k_cache, v_cache, meta, 0.35)
    got = paged_attention_fast(np, q, k_cache, v_cache, meta, 0.35)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)


def test_write_kv_skips_negative_slots():
    k_cache = np.zeros((2, 4, HKV, D), np.float32)  # [N, B, Hkv, D]
    v_cache = np.zeros((2, 4, HKV, D), np.float32)
    k = np.arange(3 * HKV * D, dtype=np.float32).reshape(3, HKV, D)  # [T, Hkv, D]
    NumpyOps().write_kv(k, -k, k_cache, v_cache, np.array([5, -1, 0], np.int32))
    np.testing.assert_array_equal(k_cache[1, 1], k[0])
    np.testing.assert_array_equal(k_cache[0, 0], k[2])
    np.testing.assert_array_equal(v_cache[0, 0], -k[2])
    assert np.count_nonzero(k_cache.reshape(8, -1).any(axis=1)) == 2


def test_copy_blocks_copies_every_layer_k_and_v():
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((3, 2, 5, 4, HKV, D)).astype(np.float32)  # [L, 2, N, B, Hkv, D]
    before = kv.copy()
    NumpyOps().copy_blocks(kv, np.array([0, 2]), np.array([4, 1]))
    np.testing.assert_array_equal(kv[:, :, 4], before[:, :, 0])
    np.testing.assert_array_equal(kv[:, :, 1], before[:, :, 2])
    np.testing.assert_array_equal(kv[:, :, [0, 2, 3]], before[:, :, [0, 2, 3]])


def test_rms_norm_residual_convention():
    rng = np.random.default_rng(4)
    x, res = rng.standard_normal((2, 3, 16)).astype(np.float32)  # [T, E] each
    w = rng.standard_normal(16).astype(np.float32)  # [E]
    normed, new_res = NumpyOps().rms_norm(x, w, 1e-6, res)
    s = x + res
    np.testing.assert_allclose(new_res, s, atol=0)
    np.testing.assert_allclose(normed, s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-6) * w, atol=1e-6)
    normed0, res0 = NumpyOps().rms_norm(x, w, 1e-6)
    assert res0 is x


def test_rope_rotates_halves_by_position_angle():
    """Position p rotates pair (j, j + D/2) by angle p * f_j; position 0 is the identity."""
    ops = NumpyOps()
    freqs = np.array([1.0, 0.1, 0.01, 0.001])  # [D/2]
    angles = np.arange(10)[:, None] * freqs  # [P, D/2]
    cache = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)  # [P, D]
    q = np.zeros((2, 1, 8)); q[:, 0, 0] = 1.0  # unit vector on dimension 0 (pairs with dimension 4)
    k = np.zeros((2, 1, 8)); k[:, 0, 5] = 1.0  # unit vector on dimension 5 (pairs with dimension 1)
    rq, rk = ops.rope(q, k, np.array([0, 3]), cache)
    np.testing.assert_allclose(rq[0, 0], q[0, 0])
    np.testing.assert_allclose(rq[1, 0, [0, 4]], [np.cos(3.0), np.sin(3.0)], atol=1e-12)
    np.testing.assert_allclose(rk[1, 0, [1, 5]], [-np.sin(0.3), np.cos(0.3)], atol=1e-12)
