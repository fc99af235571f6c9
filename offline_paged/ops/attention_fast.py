"""paged_attention_fast: the same result as `paged_attention_reference`, organised for speed.

Decode rows (q_len == 1, the bulk of a batch) are handled for all sequences at once: their K/V
are gathered through the block tables into one padded [S, C, Hkv, D] array and attended with two
batched matmuls, grouped-query heads kept as a [Hkv, G] split instead of repeating K/V.
Prefill chunks (q_len > 1) are few and large, so they go one sequence at a time.
With a sliding window only the blocks that hold keys inside some query's window are gathered.
An FP8 cache is dequantized on load with the scales folded in: k_scale into the score scale, v_scale
into the output (q.(s k) = s (q.k) and sum p (s v) = s sum p v), as a kernel would.
The reference stays the definition; tests/test_attention.py checks this against it.

Legend: T tokens, S sequences, Sd decoding sequences, H query heads, Hkv KV heads, G = H / Hkv,
D head dim, C padded context length, N blocks, B block size.
"""
from __future__ import annotations

from offline_paged.ops.attention import AttentionMetadata, check_sliding_window


def paged_attention_fast(xp, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                         sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
    """Causal GQA attention through block tables; q [T, H, D] -> [T, H, D]. With `sliding_window`
    w a query at p reads keys p - w < k <= p, and blocks wholly before the window are not read.
    K and V are read as cached K x k_scale and cached V x v_scale (an FP8 cache's scales)."""
    check_sliding_window(sliding_window)
    scale = scale * k_scale
    starts = meta.query_start_loc.tolist()
    context_lens = meta.context_lens.tolist()
    out = xp.empty(q.shape, dtype=q.dtype)  # [T, H, D]
    decode = [i for i in range(len(context_lens)) if starts[i + 1] - starts[i] == 1]
    if decode:
        rows = xp.asarray([starts[i] for i in decode])
        out[rows] = _decode(xp, q[rows], k_cache, v_cache, meta.block_tables[xp.asarray(decode)],
                            [context_lens[i] for i in decode], scale, sliding_window, v_scale)
    for i, context_len in enumerate(context_lens):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end - q_start > 1:
            out[q_start:q_end] = _prefill(xp, q[q_start:q_end], k_cache, v_cache, meta.block_tables[i],
                                          context_len, scale, sliding_window, v_scale)
    return out


def _first_key(first_query_pos: int, sliding_window: int | None) -> int:
    """The earliest key position a query at `first_query_pos` (or later) reads."""
    return 0 if sliding_window is None else max(first_query_pos - sliding_window + 1, 0)


def _gather(xp, cache, block_ids):
    """[..., Mc] block ids -> [..., Mc*B, Hkv, D] cache rows, in block order."""
    blocks = cache[block_ids]  # [..., Mc, B, Hkv, D]
    return blocks.reshape(*blocks.shape[:-4], blocks.shape[-4] * cache.shape[1], *cache.shape[2:])


def _softmax_lastdim(xp, scores):
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def _decode(xp, q, k_cache, v_cache, block_tables, context_lens: list[int], scale: float,
            sliding_window: int | None, v_scale: float = 1.0):
    """One query per sequence. q [Sd, H, D]; block_tables [Sd, M] -> [Sd, H, D].

    Each sequence reads Mc table entries from its own first block (the window's, else block 0);
    entries past a table's end are clamped to its last column and masked out."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    acc = xp.promote_types(q.dtype, xp.float32)
    lens = xp.asarray(context_lens)  # [Sd]
    first_block = xp.asarray([_first_key(c - 1, sliding_window) // block_size for c in context_lens])  # [Sd]
    num_read = max(-(-c // block_size) - int(f) for c, f in zip(context_lens, first_block.tolist()))
    block_index = first_block[:, None] + xp.arange(num_read)[None, :]  # [Sd, Mc]
    block_ids = xp.take_along_axis(block_tables, xp.minimum(block_index, block_tables.shape[1] - 1), axis=1)
    k = _gather(xp, k_cache, block_ids).astype(acc, copy=False)  # [Sd, C, Hkv, D]
    v = _gather(xp, v_cache, block_ids).astype(acc, copy=False)  # [Sd, C, Hkv, D]
    key_pos = (block_index[:, :, None] * block_size + xp.arange(block_size)).reshape(num_seqs, -1)  # [Sd, C]
    valid = key_pos < lens[:, None]  # [Sd, C]
    if sliding_window is not None:
        valid &= key_pos > lens[:, None] - 1 - sliding_window
    qg = q.astype(acc, copy=False).reshape(num_seqs, num_kv_heads, group, head_dim)  # [Sd, Hkv, G, D]
    scores = xp.matmul(qg, k.transpose(0, 2, 3, 1)) * scale  # [Sd, Hkv, G, C]
    scores = xp.where(valid[:, None, None, :], scores, -xp.inf)
    probs = _softmax_lastdim(xp, scores)  # [Sd, Hkv, G, C]
    out = xp.matmul(probs, v.transpose(0, 2, 1, 3))  # [Sd, Hkv, G, D]
    if v_scale != 1.0:
        out *= v_scale
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype, copy=False)


def _prefill(xp, q, k_cache, v_cache, block_table, context_len: int, scale: float,
             sliding_window: int | None, v_scale: float = 1.0):
    """A chunk of q_len queries at the end of a context. q [q_len, H, D] -> [q_len, H, D].
    Reads the blocks from the one holding the first query's first key to the last."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    acc = xp.promote_types(q.dtype, xp.float32)
    first_block = _first_key(context_len - q_len, sliding_window) // block_size
    block_ids = block_table[first_block:-(-context_len // block_size)]  # [Mc]
    offset = first_block * block_size  # position of the first key row read
    k = _gather(xp, k_cache, block_ids)[:context_len - offset].astype(acc, copy=False)  # [C, Hkv, D]
    v = _gather(xp, v_cache, block_ids)[:context_len - offset].astype(acc, copy=False)  # [C, Hkv, D]
    qg = q.astype(acc, copy=False).reshape(q_len, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, q_len, D]
    scores = xp.matmul(qg, k.transpose(1, 2, 0)[:, None]) * scale  # [Hkv, G, q_len, C]
    query_pos = xp.arange(context_len - q_len, context_len)[:, None]  # [q_len, 1]
    key_pos = xp.arange(offset, context_len)[None, :]  # [1, C]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    scores = xp.where(visible, scores, -xp.inf)
    probs = _softmax_lastdim(xp, scores)  # [Hkv, G, q_len, C]
    out = xp.matmul(probs, v.transpose(1, 0, 2)[:, None])  # [Hkv, G, q_len, D]
    if v_scale != 1.0:
        out *= v_scale
    return out.transpose(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).astype(q.dtype, copy=False)
