"""Paged attention (ops/attention.py): the reference == dense attention, also for a chunk at the end of a context.

The fast path is tested in test_attention_fast.py, the NumPy ops in test_ops_numpy.py."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.simple_runner import build_metadata
from offline_paged.ops.attention import dense_causal_attention, paged_attention_reference, write_kv_reference

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
