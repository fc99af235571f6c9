"""paged_attention_fast: the same result as `paged_attention_reference`, organised for speed.

Decode rows (q_len == 1, the bulk of a batch) are handled for all sequences at once: their K/V
are gathered through the block tables into one padded [S, C, Hkv, D] array and attended with two
batched matmuls, grouped-query heads kept as a [Hkv, G] split instead of repeating K/V.
Prefill chunks (q_len > 1) are few and large, so they go one sequence at a time.
The reference stays the definition; tests/test_attention.py checks this against it.

Legend: T tokens, S sequences, Sd decoding sequences, H query heads, Hkv KV heads, G = H / Hkv,
D head dim, C padded context length, N blocks, B block size.
"""
from __future__ import annotations

from .attention import AttentionMetadata


def paged_attention_fast(xp, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Causal GQA attention through block tables; q [T, H, D] -> [T, H, D]."""
    starts = meta.query_start_loc.tolist()
    context_lens = meta.context_lens.tolist()
    out = xp.empty(q.shape, dtype=q.dtype)  # [T, H, D]
    decode = [i for i in range(len(context_lens)) if starts[i + 1] - starts[i] == 1]
    if decode:
        rows = xp.asarray([starts[i] for i in decode])
        out[rows] = _decode(xp, q[rows], k_cache, v_cache, meta.block_tables[xp.asarray(decode)],
                            [context_lens[i] for i in decode], scale)
    for i, context_len in enumerate(context_lens):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end - q_start > 1:
            out[q_start:q_end] = _prefill(xp, q[q_start:q_end], k_cache, v_cache, meta.block_tables[i],
                                          context_len, scale)
    return out


def _gather(xp, cache, block_tables, context_len: int):
    """[..., M] block ids -> [..., C, Hkv, D] cache rows, C = context_len (tables cut to fit)."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache[block_tables[..., :num_blocks]]  # [..., Mc, B, Hkv, D]
    flat = blocks.reshape(*blocks.shape[:-4], num_blocks * block_size, *cache.shape[2:])  # [..., Mc*B, Hkv, D]
    return flat[..., :context_len, :, :]


def _softmax_lastdim(xp, scores):
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def _decode(xp, q, k_cache, v_cache, block_tables, context_lens: list[int], scale: float):
    """One query per sequence. q [Sd, H, D]; block_tables [Sd, M] -> [Sd, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    acc = xp.promote_types(q.dtype, xp.float32)
    max_len = max(context_lens)
    k = _gather(xp, k_cache, block_tables, max_len).astype(acc, copy=False)  # [Sd, C, Hkv, D]
    v = _gather(xp, v_cache, block_tables, max_len).astype(acc, copy=False)  # [Sd, C, Hkv, D]
    qg = q.astype(acc, copy=False).reshape(num_seqs, num_kv_heads, group, head_dim)  # [Sd, Hkv, G, D]
    scores = xp.matmul(qg, k.transpose(0, 2, 3, 1)) * scale  # [Sd, Hkv, G, C]
    valid = xp.arange(max_len)[None, :] < xp.asarray(context_lens)[:, None]  # [Sd, C]
    scores = xp.where(valid[:, None, None, :], scores, -xp.inf)
    probs = _softmax_lastdim(xp, scores)  # [Sd, Hkv, G, C]
    out = xp.matmul(probs, v.transpose(0, 2, 1, 3))  # [Sd, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype, copy=False)


def _prefill(xp, q, k_cache, v_cache, block_table, context_len: int, scale: float):
    """A chunk of q_len queries at the end of a context. q [q_len, H, D] -> [q_len, H, D]."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    acc = xp.promote_types(q.dtype, xp.float32)
    k = _gather(xp, k_cache, block_table, context_len).astype(acc, copy=False)  # [C, Hkv, D]
    v = _gather(xp, v_cache, block_table, context_len).astype(acc, copy=False)  # [C, Hkv, D]
    qg = q.astype(acc, copy=False).reshape(q_len, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, q_len, D]
    scores = xp.matmul(qg, k.transpose(1, 2, 0)[:, None]) * scale  # [Hkv, G, q_len, C]
    query_pos = xp.arange(context_len - q_len, context_len)[:, None]  # [q_len, 1]
    scores = xp.where(xp.arange(context_len)[None, :] <= query_pos, scores, -xp.inf)
    probs = _softmax_lastdim(xp, scores)  # [Hkv, G, q_len, C]
    out = xp.matmul(probs, v.transpose(1, 0, 2)[:, None])  # [Hkv, G, q_len, D]
    return out.transpose(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).astype(q.dtype, copy=False)
