"""NumpyOps: the CPU backend of the model's elementwise/attention ops, and the reference CudaOps must match.

Legend: T tokens, H query heads, Hkv key/value heads, D head dim, I intermediate size,
N physical blocks, B block size, P max positions.

FP8 KV cache: the write, attention and rope_write_kv take `kv_scales` (the layer's KvScales,
offline_paged/ops/kv_scales.py) when the pool is float8_e4m3fn; the model passes it only then (CudaOps
takes the same keyword, with a uint8 pool). Block copy and swap move the stored bytes unchanged.
"""
from __future__ import annotations

import numpy as np

from offline_paged.ops.attention import (AttentionMetadata, paged_attention_reference, split_qkv,
                                        write_kv_reference)
from offline_paged.ops.attention_fast import paged_attention_fast
from offline_paged.ops.fp8_linear import Fp8Linear
from offline_paged.ops.kv_scales import KvScales


class NumpyOps:
    """Backend ops on numpy arrays. `xp` is the array module the model uses for uploads."""

    xp = np

    def __init__(self, reference_attention: bool = False):
        # The reference loops over sequences in Python; the fast path is equal to it (tested) and
        # batches decode rows. reference_attention=True selects the reference, e.g. for debugging.
        self._attention = paged_attention_reference if reference_attention else paged_attention_fast

    def kv_storage_dtype(self, dtype) -> np.dtype:
        """The element type a KV pool of `dtype` is allocated with: `dtype` itself (ml_dtypes' float8 too)."""
        return np.dtype(dtype)

    def quantize_linear(self, w) -> Fp8Linear:
        """w [out, in] -> its FP8 layer (e4m3, one scale per output channel), used as `x @ layer`."""
        return Fp8Linear.quantize(w.T)

    def upload_fp8_linear(self, layer: Fp8Linear) -> Fp8Linear:
        """A pre-quantized checkpoint's Fp8Linear as this backend keeps it: unchanged."""
        return layer

    def rms_norm(self, x, weight, eps: float, residual=None, feeds=None):
        """RMSNorm with vLLM's residual convention: with a residual, x + residual is normalised and
        also returned as the new residual; without, x itself is the residual. Returns (normed, residual).
        `feeds`: the one linear the output goes into (CudaOps may hand an FP8 layer its quantized input
        instead; here the product quantizes, so it changes nothing)."""
        if residual is not None:
            x = x + residual  # [T, hidden]
        acc = x.astype(np.promote_types(x.dtype, np.float32), copy=False)  # [T, hidden]
        variance = np.einsum("ij,ij->i", acc, acc)[:, None] / acc.shape[-1]  # [T, 1]
        normed = (acc * (1.0 / np.sqrt(variance + eps)).astype(acc.dtype)).astype(x.dtype, copy=False)
        return normed * weight, x

    def head_rms_norm(self, q, k, q_weight, k_weight, eps: float):
        """Qwen3's q_norm / k_norm: every head of q [T, H, D] and k [T, Hkv, D] RMS-normed over D (rms_norm with
        each head a row); returns new (q, k)."""
        def per_head(x, weight):
            normed, _ = self.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)  # [T heads, D]
            return normed.reshape(x.shape)

        return per_head(q, q_weight), per_head(k, k_weight)

    def rope(self, q, k, positions, cos_sin_cache):
        """Rotate-half RoPE (HF / neox pairing). q: [T, H, D], k: [T, Hkv, D]; returns new arrays."""
        half = cos_sin_cache.shape[1] // 2
        table = cos_sin_cache[positions]  # [T, D]
        cos = table[:, None, :half]  # [T, 1, D/2]
        sin = table[:, None, half:]  # [T, 1, D/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales: KvScales | None = None) -> None:
        """Scatter k, v [T, Hkv, D] into the caches by slot (negative: skipped). With `kv_scales` (an FP8
        pool) the rows are quantized by its scales, which a KvScales still to `calculate` first takes
        from these rows."""
        if kv_scales is None:
            write_kv_reference(np, k, v, k_cache, v_cache, slot_mapping)
            return
        if kv_scales.calculate:
            keep = slot_mapping >= 0  # [T] (padding rows must not set the scales)
            kv_scales.observe(k[keep], v[keep])
        write_kv_reference(np, k, v, k_cache, v_cache, slot_mapping, kv_scales.k_scale, kv_scales.v_scale)

    def rope_write_kv(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                      kv_scales: KvScales | None = None):
        """rope, then write_kv of the rotated k and of v (negative slots skipped); returns the rotated q
        [T, H, D]. The definition CudaOps' one-kernel version must equal."""
        q, k = self.rope(q, k, positions, cos_sin_cache)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        return q

    def qkv_rope_write_kv(self, qkv, num_heads: int, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                          kv_scales: KvScales | None = None):
        """rope_write_kv of the q, k, v columns of a qkv projection's output [T, (H + 2 Hkv) D] (Hkv and D: the
        cache's); returns the rotated q [T, H, D]. CudaOps reads an FP8 projection's product before its epilogue."""
        q, k, v = split_qkv(qkv, num_heads, *k_cache.shape[2:])
        return self.rope_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kv_scales)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  sliding_window: int | None = None, kv_scales: KvScales | None = None, feeds=None):
        """Paged causal GQA attention; [T, H, D] -> [T, H, D]. With `sliding_window` w, a query at
        position p reads only keys p - w < k <= p (None: the whole context). With `kv_scales` the
        cached K and V are dequantized by its scales on load. `feeds`: the one linear the output goes into
        (o_proj); the result is then its input rows [T, H D] (CudaOps may hand an FP8 layer its quantized input
        instead, as rms_norm's `feeds`)."""
        scales = () if kv_scales is None else (kv_scales.k_scale, kv_scales.v_scale)
        out = self._attention(np, q, k_cache, v_cache, meta, scale, sliding_window, *scales)  # [T, H, D]
        return out if feeds is None else out.reshape(out.shape[0], -1)

    def logits(self, hidden, lm_head):
        """hidden [K, E] @ lm_head [E, V] -> [K, V] float32 (computed in the model's dtype)."""
        return (hidden @ lm_head).astype(np.float32)

    def add_bias(self, x, bias):
        """x + bias over the last axis (x [T, N], bias [N]); CudaOps may update x in place."""
        return x + bias

    def deferred(self, linear):
        """`linear` in the form whose product may skip its scale epilogue (CudaOps: FP8 layers); here itself."""
        return linear

    def silu_mul(self, gate_up, feeds=None):
        """SwiGLU activation: silu(gate) * up for gate_up = concat(gate, up); [T, 2I] -> [T, I]. `feeds`: as
        rms_norm's."""
        inter = gate_up.shape[-1] // 2
        gate = gate_up[:, :inter]  # [T, I]
        with np.errstate(over="ignore"):  # exp(-gate) -> inf for very negative gate gives silu = -0
            return gate / (1.0 + np.exp(-gate)) * gate_up[:, inter:]

    def copy_blocks(self, kv_cache, src_ids, dst_ids) -> None:
        """kv_cache[:, :, dst] = kv_cache[:, :, src] for all layers, K and V (all reads before writes)."""
        kv_cache[:, :, dst_ids] = kv_cache[:, :, src_ids]

    def make_swapper(self, kv_cache, num_cpu_blocks: int) -> "HostSwapper":
        """A CPU pool of `num_cpu_blocks` blocks for `kv_cache`, with swap_out / swap_in (as CudaOps)."""
        return HostSwapper(kv_cache, num_cpu_blocks)


class HostSwapper:
    """The CPU counterpart of cuda.swap.BlockSwapper: a second numpy pool [L, 2, C, B, Hkv, D] and
    whole-block gathers on axis 2 between it and the device pool (here also numpy)."""

    def __init__(self, kv_cache, num_cpu_blocks: int):
        shape = (*kv_cache.shape[:2], num_cpu_blocks, *kv_cache.shape[3:])
        self.gpu_cache = kv_cache
        self.cpu_cache = np.zeros(shape, dtype=kv_cache.dtype)  # [L, 2, C, B, Hkv, D]

    def swap_out(self, gpu_ids, cpu_ids) -> None:
        """cpu_cache[:, :, cpu_ids] <- gpu_cache[:, :, gpu_ids]."""
        self.cpu_cache[:, :, np.asarray(cpu_ids, dtype=np.int64)] = \
            self.gpu_cache[:, :, np.asarray(gpu_ids, dtype=np.int64)]

    def swap_in(self, cpu_ids, gpu_ids) -> None:
        """gpu_cache[:, :, gpu_ids] <- cpu_cache[:, :, cpu_ids]."""
        self.gpu_cache[:, :, np.asarray(gpu_ids, dtype=np.int64)] = \
            self.cpu_cache[:, :, np.asarray(cpu_ids, dtype=np.int64)]


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1 = x[..., :half]  # [T, heads, D/2]
    x2 = x[..., half:]  # [T, heads, D/2]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
