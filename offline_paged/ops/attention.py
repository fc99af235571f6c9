"""Paged attention: the metadata a forward needs and the NumPy reference every CUDA kernel is tested against.

Legend for shape comments:
    T  tokens in the batch (all sequences' query tokens, concatenated)
    S  sequences in the batch
    H  query heads, Hkv key/value heads (H % Hkv == 0), D head dim
    N  physical KV blocks in the pool, B block size (tokens per block), M max blocks per sequence

KV cache layout (one contiguous array per model, so a block copy or swap is one gather):
    kv_cache[layer, 0] is K, kv_cache[layer, 1] is V, each [N, B, Hkv, D].
    Token position p of a sequence lives in physical block block_table[p // B], offset p % B;
    its *slot* is block_table[p // B] * B + p % B.

Query layout: the queries of sequence i are rows query_start_loc[i]:query_start_loc[i + 1] of q.
Sequence i has context_lens[i] tokens in its cache after this step's K/V are written; its q_len
queries sit at positions context_lens[i] - q_len ... context_lens[i] - 1 and attend causally,
so a decode step is q_len == 1 and a prefill chunk attends to the cached prefix plus causally
within the chunk.

FP8 KV cache (NumPy backend only): the pool is float8_e4m3fn; the write stores clip(x / scale, +-448) and
attention reads stored * scale, with one K and one V scale per layer (offline_paged/ops/kv_scales.py).
With the model's own dtype the scales are 1.0 and change nothing.

Sliding window (Mistral): with `sliding_window` w, the query at position p reads only the keys at
positions p - w < k <= p, itself and the w - 1 before it (transformers' convention: its mask keeps
kv_idx > q_idx - w). None means the whole causal context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_paged.ops.kv_scales import dequantize, is_fp8, quantize_fp8


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one forward, passed explicitly (no global context).

    Arrays live on the backend's device (numpy or cupy) and are int32.
    """

    slot_mapping: Any  # [T] cache slot each new token's K/V goes to; negative = skip (padding)
    block_tables: Any  # [S, M] physical block ids; entries past a sequence's blocks are padding (0)
    context_lens: Any  # [S] tokens in each sequence's cache after this step
    query_start_loc: Any  # [S + 1] prefix sums of query lengths
    max_query_len: int
    max_context_len: int
    # Whether q may have rows past query_start_loc[S] (rows of no sequence; attention returns zeros
    # there). False only where every row is some sequence's query (the decode graphs' buckets, whose
    # padding slots are one-token sequences): the CUDA kernel then writes every row and no zero-fill runs.
    unqueried_rows: bool = True
    # [S] int32, a permutation of the sequences: the order the CUDA kernel launches them in (longest first,
    # computed on the device by the decode graphs). None: index order. Only the speed depends on it.
    launch_order: Any = None
    # The first this-many sequences are decodes (one query row each; the scheduler puts them first). The
    # CUDA backend then runs them through the decode kernel and the rest through the prefill kernel, instead
    # of one launch sized for the longest query. 0: one launch for all. The result is the same.
    num_leading_decodes: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """The q [T, H, D], k [T, Hkv, D] and v [T, Hkv, D] views of a fused qkv projection's output [T, (H + 2 Hkv) D]."""
    num_tokens, q_dim, kv_dim = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_dim].reshape(num_tokens, num_heads, head_dim),
            qkv[:, q_dim:q_dim + kv_dim].reshape(num_tokens, num_kv_heads, head_dim),
            qkv[:, q_dim + kv_dim:].reshape(num_tokens, num_kv_heads, head_dim))


def write_kv_reference(xp, k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> None:
    """Scatter new K/V rows into the cache by slot; rows whose slot is negative are skipped.
    An FP8 cache (NumPy) stores clip(k / k_scale, +-448) and clip(v / v_scale, +-448) rounded to e4m3.

    k, v: [T, Hkv, D]; k_cache, v_cache: [N, B, Hkv, D] (written in place).
    """
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_rows, v_rows = k[keep], v[keep]  # [T', Hkv, D]
    if is_fp8(k_cache.dtype):
        k_rows, v_rows = quantize_fp8(k_rows, k_scale), quantize_fp8(v_rows, v_scale)
    k_cache.reshape(num_blocks * block_size, *k_cache.shape[2:])[slots] = k_rows
    v_cache.reshape(num_blocks * block_size, *v_cache.shape[2:])[slots] = v_rows


def check_sliding_window(sliding_window) -> None:
    """ValueError unless `sliding_window` is None or a positive int (the attention ops' keyword)."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def paged_attention_reference(xp, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                              sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
    """Causal grouped-query attention reading K/V through block tables. Returns [T, H, D].
    With `sliding_window` w, a query at position p sees only keys p - w < k <= p.
    K and V are dequantized on load: cached K x k_scale, cached V x v_scale (1.0: as stored).

    Plain per-sequence loop on purpose: this is the readable definition the kernels must match.
    Softmax is computed in float32 at least (float64 inputs stay float64).
    """
    check_sliding_window(sliding_window)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    acc_dtype = xp.promote_types(q.dtype, xp.float32)
    out = xp.zeros(q.shape, dtype=q.dtype)  # [T, H, D]
    starts = [int(s) for s in meta.query_start_loc.tolist()]
    context_lens = [int(c) for c in meta.context_lens.tolist()]
    for i, context_len in enumerate(context_lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-context_len // block_size)
        blocks = meta.block_tables[i, :num_blocks]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len]  # [C, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len]  # [C, Hkv, D]
        k = xp.repeat(dequantize(k, k_scale, acc_dtype), group, axis=1)  # [C, H, D]
        v = xp.repeat(dequantize(v, v_scale, acc_dtype), group, axis=1)  # [C, H, D]
        qs = q[q_start:q_end].astype(acc_dtype)  # [q_len, H, D]
        scores = xp.einsum("qhd,khd->hqk", qs, k) * scale  # [H, q_len, C]
        query_pos = xp.arange(context_len - q_len, context_len)[:, None]  # [q_len, 1]
        key_pos = xp.arange(context_len)[None, :]  # [1, C]
        scores = xp.where(_visible(key_pos, query_pos, sliding_window), scores, -xp.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[q_start:q_end] = xp.einsum("hqk,khd->qhd", probs, v).astype(q.dtype)
    return out


def _visible(key_pos, query_pos, sliding_window: int | None):
    """Which keys each query reads: causal, and inside the window when there is one."""
    causal = key_pos <= query_pos
    return causal if sliding_window is None else causal & (key_pos > query_pos - sliding_window)


def dense_causal_attention(xp, q, k, v, scale: float, sliding_window: int | None = None):
    """Plain causal GQA attention for one sequence held contiguously (the "paged == dense" check).

    q: [L, H, D]; k, v: [L, Hkv, D]. Returns [L, H, D].
    """
    group = q.shape[1] // k.shape[1]
    acc_dtype = xp.promote_types(q.dtype, xp.float32)
    k = xp.repeat(k.astype(acc_dtype), group, axis=1)  # [L, H, D]
    v = xp.repeat(v.astype(acc_dtype), group, axis=1)  # [L, H, D]
    scores = xp.einsum("qhd,khd->hqk", q.astype(acc_dtype), k) * scale  # [H, L, L]
    length = q.shape[0]
    positions = xp.arange(length)
    mask = _visible(positions[None, :], positions[:, None], sliding_window)  # [L, L]
    scores = xp.where(mask, scores, -xp.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return xp.einsum("hqk,khd->qhd", probs, v).astype(q.dtype)
