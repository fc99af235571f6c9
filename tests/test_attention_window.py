"""Sliding-window paged attention (Mistral): a query at position p reads keys p - w < k <= p.

Checked against a per-query loop written from that definition, then paged == dense, fast == reference
on mixed batches, and the fast path never reading a block wholly before every query's window."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.simple_runner import build_metadata
from offline_paged.ops.attention import dense_causal_attention, paged_attention_reference
from offline_paged.ops.attention_fast import paged_attention_fast
from offline_paged.ops.ops_numpy import NumpyOps
from test_attention import H, HKV, _scatter_sequences


def _case(seed, lengths, query_lens, block_size, dtype=np.float32):
    """As test_attention's, with a pool large enough for any of these cases (block size 1 included)."""
    rng = np.random.default_rng(seed)
    k_cache, v_cache, tables, ks, vs = _scatter_sequences(rng, lengths, block_size, sum(lengths) + 8, dtype)
    q = rng.standard_normal((sum(query_lens), H, 8)).astype(dtype)  # [T, H, D]
    meta = build_metadata(np, tables, lengths, query_lens, slot_mapping=[-1] * sum(query_lens))
    return q, k_cache, v_cache, meta, ks, vs


def _loop_attention(q, k, v, scale, window):
    """One query at a time: softmax over keys max(0, p - window + 1) .. p. q [L, H, D]; k, v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    out = np.empty_like(q, dtype=np.float64)
    for p in range(q.shape[0]):
        lo = max(0, p - window + 1)
        for h in range(q.shape[1]):
            scores = k[lo:p + 1, h // group].astype(np.float64) @ q[p, h].astype(np.float64) * scale
            probs = np.exp(scores - scores.max())
            out[p, h] = probs @ v[lo:p + 1, h // group] / probs.sum()
    return out


@pytest.mark.parametrize("window", [1, 3, 8, 50])
def test_dense_window_matches_the_per_query_definition(window):
    rng = np.random.default_rng(window)
    q = rng.standard_normal((20, H, 8))  # [L, H, D]
    k, v = rng.standard_normal((2, 20, HKV, 8))  # [L, Hkv, D] each
    np.testing.assert_allclose(dense_causal_attention(np, q, k, v, 0.4, sliding_window=window),
                               _loop_attention(q, k, v, 0.4, window), atol=1e-12, rtol=0)


def test_a_window_changes_the_result_once_the_sequence_is_longer():
    """Sanity: w = 8 equals full attention on the first 8 positions and differs after them."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((12, H, 8))  # [L, H, D]
    k, v = rng.standard_normal((2, 12, HKV, 8))  # [L, Hkv, D] each
    full = dense_causal_attention(np, q, k, v, 0.4)
    windowed = dense_causal_attention(np, q, k, v, 0.4, sliding_window=8)
    np.testing.assert_allclose(windowed[:8], full[:8], atol=1e-12, rtol=0)
    assert np.abs(windowed[8:] - full[8:]).min(axis=(1, 2)).min() > 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_paged_window_equals_dense_window(block_size, window):
    lengths = [5, 17, 1, 40]
    q, k_cache, v_cache, meta, ks, vs = _case(2, lengths, lengths, block_size, np.float64)
    for attention in (paged_attention_reference, paged_attention_fast):
        out = attention(np, q, k_cache, v_cache, meta, 0.3, sliding_window=window)  # [T, H, D]
        start = 0
        for length, k, v in zip(lengths, ks, vs):
            dense = dense_causal_attention(np, q[start:start + length], k, v, 0.3, sliding_window=window)
            np.testing.assert_allclose(out[start:start + length], dense, atol=1e-12, rtol=0)
            start += length


@pytest.mark.parametrize("seed", range(8))
def test_fast_window_equals_reference_on_mixed_batches(seed):
    """Decodes, first chunks and later chunks together; windows smaller and larger than contexts."""
    rng = np.random.default_rng(300 + seed)
    num_seqs = int(rng.integers(1, 7))
    lengths = rng.integers(1, 60, size=num_seqs).tolist()
    query_lens = [int(rng.integers(1, n + 1)) if rng.random() < 0.4 else 1 for n in lengths]
    block_size = int(rng.choice([1, 3, 4, 16]))
    window = int(rng.choice([1, 2, 7, 8, 20, 64]))
    q, k_cache, v_cache, meta, _, _ = _case(seed, lengths, query_lens, block_size)
    want = paged_attention_reference(np, q, k_cache, v_cache, meta, 0.35, sliding_window=window)
    got = paged_attention_fast(np, q, k_cache, v_cache, meta, 0.35, sliding_window=window)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert NumpyOps().attention(q, k_cache, v_cache, meta, 0.35, sliding_window=window).tobytes() == got.tobytes()


@pytest.mark.parametrize("query_lens", [[1, 1], [6, 1], [1, 9]])
def test_fast_path_reads_no_block_before_the_window(query_lens):
    """Table entries wholly before every query's window point at a NaN-filled block: the output stays
    finite and equal to the reference on the clean tables (so such blocks may be reused elsewhere)."""
    block_size, window, lengths = 4, 6, [30, 23]
    rng = np.random.default_rng(7)
    k_cache, v_cache, tables, _, _ = _scatter_sequences(rng, lengths, block_size, 32, np.float64)
    q = rng.standard_normal((sum(query_lens), H, 8))  # [T, H, D]
    meta = build_metadata(np, tables, lengths, query_lens, [-1] * sum(query_lens))
    want = paged_attention_reference(np, q, k_cache, v_cache, meta, 0.3, sliding_window=window)
    poison = min(set(range(32)) - {b for t in tables for b in t})  # a block no sequence holds
    k_cache[poison] = v_cache[poison] = np.nan
    for i, (length, q_len) in enumerate(zip(lengths, query_lens)):
        first_key = max(length - q_len - window + 1, 0)
        meta.block_tables[i, :first_key // block_size] = poison
    got = paged_attention_fast(np, q, k_cache, v_cache, meta, 0.3, sliding_window=window)
    np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_window_is_refused(bad):
    q, k_cache, v_cache, meta, _, _ = _case(0, [5], [5], 4)
    for attention in (paged_attention_reference, paged_attention_fast):
        with pytest.raises(ValueError, match="sliding_window must be a positive int or None"):
            attention(np, q, k_cache, v_cache, meta, 0.3, sliding_window=bad)
