"""CudaOps: the GPU backend of the model's ops, method for method the semantics of NumpyOps.

fp16 or bf16 activations and KV cache (the model's dtype; the launchers pick the kernels from the arrays'
dtype), fp32 accumulation inside every kernel; matmuls stay with cuBLAS through `xp` (cupy). Every method enqueues work on the current stream and returns without synchronising.
Legend: T tokens, H query heads, Hkv KV heads, D head dim, I intermediate size, N blocks, B block size.
"""
from __future__ import annotations

import cupy
import numpy as np

from offline_paged.ops.attention import AttentionMetadata

from offline_paged.ops import launchers
from offline_paged.ops.swap import BlockSwapper


def _int32(values):
    """Metadata as a contiguous int32 device array (a no-op for what the runner already built)."""
    if isinstance(values, cupy.ndarray) and values.dtype == np.int32 and values.flags.c_contiguous:
        return values
    return cupy.ascontiguousarray(cupy.asarray(values, dtype=cupy.int32))


class CudaOps:
    """Backend ops on cupy arrays (float16 or bfloat16: launchers raise ValueError for other dtypes)."""

    xp = cupy

    def __init__(self) -> None:
        self._logits_gemm = None  # CublasGemm on the null stream, made on first use

    def rms_norm(self, x, weight, eps: float, residual=None):
        """RMSNorm with vLLM's residual convention; returns (normed [T, E], residual [T, E])."""
        return launchers.rms_norm(cupy.ascontiguousarray(x), weight, eps,
                                  None if residual is None else cupy.ascontiguousarray(residual))

    def rope(self, q, k, positions, cos_sin_cache):
        """Rotate-half RoPE; q [T, H, D], k [T, Hkv, D] (row-strided views are fine); returns new arrays."""
        return launchers.rope(q, k, _int32(positions), cos_sin_cache)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        launchers.write_kv(k, v, k_cache, v_cache, _int32(slot_mapping))

    def rope_write_kv(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
        """rope then write_kv in one kernel: returns the rotated q [T, H, D]; the rotated k and v go
        straight into the cache rows slot_mapping[t] (negative: skipped). Bit for bit rope + write_kv."""
        return launchers.rope_write_kv(q, k, v, _int32(positions), cos_sin_cache, k_cache, v_cache,
                                       _int32(slot_mapping))

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  sliding_window: int | None = None):
        """Paged causal GQA attention; [T, H, D] -> [T, H, D]. sliding_window: a query at position p
        sees only keys at positions > p - sliding_window (None or 0: the whole causal context).
        With meta.num_leading_decodes = d (0 < d < S, a longer query after them), rows [0, d) go through
        the decode kernel and the rest through the kernel of their longest query, in two launches."""
        q = cupy.ascontiguousarray(q)
        tables, lens, starts = _int32(meta.block_tables), _int32(meta.context_lens), _int32(meta.query_start_loc)
        window = int(sliding_window or 0)
        d = meta.num_leading_decodes
        if 0 < d < lens.shape[0] and meta.launch_order is None and meta.max_query_len > 1:
            decodes = launchers.paged_attention(q[:d], k_cache, v_cache, tables[:d], lens[:d], starts[:d + 1], 1,
                                                int(meta.max_context_len), scale, window=window, zero_fill=False)
            rest = launchers.paged_attention(q[d:], k_cache, v_cache, tables[d:], lens[d:], starts[d:] - d,
                                             int(meta.max_query_len), int(meta.max_context_len), scale,
                                             window=window, zero_fill=meta.unqueried_rows)
            return cupy.concatenate([decodes, rest])  # [T, H, D]
        return launchers.paged_attention(
            q, k_cache, v_cache, tables, lens, starts, int(meta.max_query_len), int(meta.max_context_len), scale,
            window=window, zero_fill=meta.unqueried_rows,
            launch_order=None if meta.launch_order is None else _int32(meta.launch_order))

    def logits(self, hidden, lm_head):
        """hidden [K, E] @ lm_head [E, V] -> [K, V] float32: for fp16 and bf16 the GEMM writes its fp32
        accumulator (no rounding of the logits to fp16/bf16 first); other dtypes matmul, then cast."""
        if hidden.dtype != lm_head.dtype or hidden.dtype not in launchers.ELEMENT_SUFFIX:
            return (hidden @ lm_head).astype(cupy.float32)
        if self._logits_gemm is None:
            from offline_paged.ops.graphs import CublasGemm

            self._logits_gemm = CublasGemm(cupy.cuda.Stream.null)  # the eager steps' stream
        return self._logits_gemm(cupy.ascontiguousarray(hidden), lm_head, out_dtype=np.float32)

    def add_bias(self, x, bias):
        """x + bias over the last axis; may update x in place (x [T, N], bias [N])."""
        return launchers.add_bias(cupy.ascontiguousarray(x), bias)

    def silu_mul(self, gate_up):
        """silu(gate) * up for gate_up = concat(gate, up); [T, 2I] -> [T, I]."""
        return launchers.silu_mul(cupy.ascontiguousarray(gate_up))

    def copy_blocks(self, kv_cache, src_ids, dst_ids) -> None:
        """kv_cache[:, :, dst] = kv_cache[:, :, src] for all layers, K and V, as if all reads came first."""
        src_host = np.asarray(cupy.asnumpy(src_ids) if isinstance(src_ids, cupy.ndarray) else src_ids).reshape(-1)
        dst_host = np.asarray(cupy.asnumpy(dst_ids) if isinstance(dst_ids, cupy.ndarray) else dst_ids).reshape(-1)
        if not src_host.size:
            return
        if np.intersect1d(src_host, dst_host).size:  # a chain: read everything before writing anything
            kv_cache[:, :, cupy.asarray(dst_host)] = kv_cache[:, :, cupy.asarray(src_host)]
            return
        launchers.copy_blocks(kv_cache, _int32(src_host), _int32(dst_host))

    def make_swapper(self, kv_cache, num_cpu_blocks: int) -> BlockSwapper:
        """A pinned CPU pool of `num_cpu_blocks` blocks for `kv_cache`, with swap_out / swap_in."""
        return BlockSwapper(kv_cache, num_cpu_blocks)
