"""CudaOps: the GPU backend of the model's ops, method for method the semantics of NumpyOps.

fp16 or bf16 activations and KV cache (the model's dtype; the launchers pick the kernels from the arrays'
dtype), fp32 accumulation inside every kernel; matmuls stay with cuBLAS through `xp` (cupy). Every method enqueues work on the current stream and returns without synchronising.
Legend: T tokens, H query heads, Hkv KV heads, D head dim, I intermediate size, N blocks, B block size.

FP8 KV cache: the pool is uint8 (the e4m3fn bits; `kv_storage_dtype`) and the KV write, rope_write_kv and
attention take the layer's `kv_scales` (a KvScales) as NumpyOps does. The kernels read the scales from a
[2] float32 device buffer per KvScales, made once and updated in place, so a captured CUDA graph always
replays the current scales. A KvScales still to `calculate` takes its scales from the first eager write
that has rows (one device-to-host read of max|k| and max|v|, once per layer); a write while a graph is
being captured never calculates (the graph reads the buffer the first eager prefill then fills).

FP8 weights: `quantize_linear` / `upload_fp8_linear` build CudaFp8Linear layers (ops/cuda_fp8_linear.py) whose eager
`x @ layer` runs through `fp8_gemm()`: one TunedGemm per stream, made on first use on that stream.
"""
from __future__ import annotations

import dataclasses

import cupy
import numpy as np

from offline_paged.ops.attention import AttentionMetadata, split_qkv
from offline_paged.ops import cuda_fp8_linear
from offline_paged.ops.cuda_fp8_linear import CudaFp8Linear, Fp8Product, Fp8Rows
from offline_paged.ops.fp8_linear import Fp8Linear
from offline_paged.ops.kv_scales import FP8_STORAGE_CUDA, KvScales, is_fp8
from offline_paged.ops.logits_rows import logits_buckets, logits_rows

from offline_paged.ops import launchers
from offline_paged.ops.swap import BlockSwapper

# An FP8 qkv projection's product goes into rope_write_kv before its scale epilogue (CudaOps.qkv_rope_write_kv: one
# launch and the [T, (H + 2 Hkv) D] 16-bit output's trip through memory fewer a layer); False: the epilogue, then
# rope_write_kv (the same bytes either way).
FOLD_QKV_EPILOGUE = True


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
        # id(KvScales) -> (the KvScales, kept alive so its id stays unique; its [2] float32 device buffer)
        self._kv_scale_buffers: dict[int, tuple[KvScales, cupy.ndarray]] = {}
        self._fp8_gemms: dict[int, object] = {}  # stream pointer -> the TunedGemm of eager FP8 products on it
        self._deferred: dict[int, tuple] = {}  # id(FP8 layer) -> (the layer, kept alive; its deferred twin)
        self._split_meta = None  # (the AttentionMetadata, kept alive; its decode and rest parts): `_split`

    def quantize_linear(self, w) -> CudaFp8Linear:
        """w [out, in] (this backend's 16-bit dtype) -> its FP8 layer: e4m3, one scale per output channel."""
        return CudaFp8Linear.quantize(w, self.fp8_gemm)

    def upload_fp8_linear(self, layer: Fp8Linear) -> CudaFp8Linear:
        """A host Fp8Linear (a pre-quantized checkpoint's) on the device, its e4m3 values and scales unchanged."""
        return CudaFp8Linear.upload(layer, self.fp8_gemm)

    def fp8_gemm(self):
        """The TunedGemm of the current stream (eager FP8 products), made on first use outside any capture. It
        takes cuBLASLt's first candidate per shape (tune=False): eager steps see many row counts, and timing
        each would cost more than it saves; the decode graphs' own TunedGemm times its few bucket shapes."""
        stream = cupy.cuda.get_current_stream()
        gemm = self._fp8_gemms.get(stream.ptr)
        if gemm is None:
            from offline_paged.ops.cublaslt import TunedGemm

            gemm = self._fp8_gemms[stream.ptr] = TunedGemm(stream, tune=False)
        return gemm

    def kv_storage_dtype(self, dtype) -> np.dtype:
        """The element type a KV pool of `dtype` is allocated with here: uint8 for FP8 (CuPy has no float8)."""
        return FP8_STORAGE_CUDA if is_fp8(dtype) else np.dtype(dtype)

    def kv_scale_buffer(self, kv_scales: KvScales | None):
        """The [2] float32 device array (k_scale, v_scale) the FP8 kernels read for `kv_scales` (None: None).
        Made on first use (outside any graph capture: the warm-up runs first) and kept: graphs hold its address."""
        if kv_scales is None:
            return None
        entry = self._kv_scale_buffers.get(id(kv_scales))
        if entry is None or entry[0] is not kv_scales:
            entry = (kv_scales, cupy.asarray(np.array([kv_scales.k_scale, kv_scales.v_scale], dtype=np.float32)))
            self._kv_scale_buffers[id(kv_scales)] = entry
        return entry[1]

    def _calculate_kv_scales(self, kv_scales: KvScales, k, v, slot_mapping) -> None:
        """If `kv_scales` is still to calculate and this is no graph capture: set it from max|k|, max|v| over
        the rows with a slot (vLLM's rule, KvScales.observe_amax) and copy it into its device buffer."""
        if not kv_scales.calculate or _capturing():
            return
        keep = slot_mapping >= 0  # [T] (padding rows must not set the scales)
        if not bool(keep.any()):
            return
        k_amax = float(cupy.abs(k[keep].astype(cupy.float32)).max())
        v_amax = float(cupy.abs(v[keep].astype(cupy.float32)).max())
        kv_scales.observe_amax(k_amax, v_amax)
        self.kv_scale_buffer(kv_scales).set(np.array([kv_scales.k_scale, kv_scales.v_scale], dtype=np.float32))

    def rms_norm(self, x, weight, eps: float, residual=None, feeds=None):
        """RMSNorm with vLLM's residual convention; returns (normed [T, E], residual [T, E]). When `feeds` (the
        one linear the output goes into) is an FP8 layer, normed is its quantized input instead (Fp8Rows), made
        by the same kernel: the same bytes as quantizing the 16-bit output, one launch fewer."""
        residual = None if residual is None else cupy.ascontiguousarray(residual)
        if _takes_fp8_rows(feeds):
            product = x.args if isinstance(x, Fp8Product) else None
            x = None if product else cupy.ascontiguousarray(x)
            xq, scales, residual_out = launchers.rms_norm_fp8(x, weight, eps, residual, feeds.weight.shape[1],
                                                              feeds.input_scale, product=product)
            return Fp8Rows(xq, scales, weight.shape[0], weight.dtype), residual_out
        x = x.materialize() if isinstance(x, Fp8Product) else cupy.ascontiguousarray(x)
        return launchers.rms_norm(x, weight, eps, residual)

    def head_rms_norm(self, q, k, q_weight, k_weight, eps: float):
        """Qwen3's q_norm / k_norm: every head of q [T, H, D] and k [T, Hkv, D] RMS-normed over D, in one kernel;
        returns new (q, k). Row-strided views (slices of the qkv row) are read in place."""
        return launchers.head_rms_norm(q, k, q_weight, k_weight, eps)

    def rope(self, q, k, positions, cos_sin_cache):
        """Rotate-half RoPE; q [T, H, D], k [T, Hkv, D] (row-strided views are fine); returns new arrays."""
        return launchers.rope(q, k, _int32(positions), cos_sin_cache)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales: KvScales | None = None) -> None:
        """Scatter k, v [T, Hkv, D] into the caches by slot (negative: skipped); with `kv_scales` (an FP8
        pool) quantized by its scales, which a KvScales still to calculate first takes from these rows."""
        slots = _int32(slot_mapping)
        if kv_scales is not None:
            self._calculate_kv_scales(kv_scales, k, v, slots)
        launchers.write_kv(k, v, k_cache, v_cache, slots, kv_scale=self.kv_scale_buffer(kv_scales))

    def rope_write_kv(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                      kv_scales: KvScales | None = None):
        """rope then write_kv in one kernel: returns the rotated q [T, H, D]; the rotated k and v go
        straight into the cache rows slot_mapping[t] (negative: skipped). Bit for bit rope + write_kv.
        A KvScales still to calculate runs rope, then write_kv (its scales come from the rotated k)."""
        positions, slots = _int32(positions), _int32(slot_mapping)
        if kv_scales is not None and kv_scales.calculate and not _capturing():
            q, k = launchers.rope(q, k, positions, cos_sin_cache)
            self.write_kv(k, v, k_cache, v_cache, slots, kv_scales)
            return q
        return launchers.rope_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slots,
                                       kv_scale=self.kv_scale_buffer(kv_scales))

    def qkv_rope_write_kv(self, qkv, num_heads: int, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                          kv_scales: KvScales | None = None):
        """NumpyOps.qkv_rope_write_kv. qkv may be an FP8 projection's Fp8Product (CudaOps.deferred): one kernel
        then reads it before its scale epilogue (launchers.rope_write_kv_product, byte for byte the epilogue and
        rope_write_kv), where that kernel fits it and no KvScales is still to be calculated."""
        if isinstance(qkv, Fp8Product):
            calculating = kv_scales is not None and kv_scales.calculate and not _capturing()
            if FOLD_QKV_EPILOGUE and not calculating and launchers.rope_write_kv_product_fits(
                    qkv.args, qkv.dtype, k_cache.shape[3], cos_sin_cache):
                return launchers.rope_write_kv_product(
                    qkv.args, qkv.dtype, num_heads, _int32(positions), cos_sin_cache, k_cache, v_cache,
                    _int32(slot_mapping), kv_scale=self.kv_scale_buffer(kv_scales))
            qkv = qkv.materialize()
        q, k, v = split_qkv(qkv, num_heads, *k_cache.shape[2:])
        return self.rope_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kv_scales)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  sliding_window: int | None = None, kv_scales: KvScales | None = None, out=None, feeds=None):
        """Paged causal GQA attention; [T, H, D] -> [T, H, D]. sliding_window: a query at position p
        sees only keys at positions > p - sliding_window (None or 0: the whole causal context).
        With meta.num_leading_decodes = d (0 < d < S, a longer query after them), rows [0, d) go through
        the decode kernel and the rest through the kernel of their longest query, in two launches writing
        one output. With `kv_scales` (an FP8 pool) cached K and V are read times its scales.
        out: a C-contiguous [T, H, D] array to write the result into (None: a new one).
        feeds: as NumpyOps.attention's; an FP8 layer (fusion on) gets its Fp8Rows, which the decode kernel itself
        quantizes where it can (launchers.paged_attention's `quantize`), else a quantize launch after it."""
        q = cupy.ascontiguousarray(q)
        kv_scale = self.kv_scale_buffer(kv_scales)
        window = int(sliding_window or 0)
        quantize = (feeds.weight.shape[1], feeds.input_scale) if out is None and _takes_fp8_rows(feeds) else None
        result = self._attention(q, k_cache, v_cache, meta, scale, window, kv_scale, out, quantize)
        if isinstance(result, tuple):  # (out, xq, scales)
            return Fp8Rows(result[1], result[2], q.shape[1] * q.shape[2], q.dtype)
        return result if feeds is None else result.reshape(result.shape[0], -1)  # (an FP8 feeds quantizes it)

    def _attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int, kv_scale, out,
                   quantize):
        """`attention`'s launches: out [T, H, D], or with `quantize` (launchers.paged_attention's) in one launch,
        (out, xq, scales)."""
        d = meta.num_leading_decodes
        if 0 < d < meta.context_lens.shape[0] and meta.launch_order is None and meta.max_query_len > 1:
            out = cupy.empty(q.shape, dtype=q.dtype) if out is None else out
            (tables, lens, starts), rest = self._split(meta)
            launchers.paged_attention(q[:d], k_cache, v_cache, tables, lens, starts, 1, int(meta.max_context_len),
                                      scale, window=window, zero_fill=False, kv_scale=kv_scale, out=out[:d])
            tables, lens, starts = rest
            launchers.paged_attention(q[d:], k_cache, v_cache, tables, lens, starts, int(meta.max_query_len),
                                      int(meta.max_context_len), scale, window=window, zero_fill=meta.unqueried_rows,
                                      kv_scale=kv_scale, out=out[d:])
            return out  # [T, H, D]
        return launchers.paged_attention(
            q, k_cache, v_cache, _int32(meta.block_tables), _int32(meta.context_lens), _int32(meta.query_start_loc),
            int(meta.max_query_len), int(meta.max_context_len), scale, window=window, zero_fill=meta.unqueried_rows,
            launch_order=None if meta.launch_order is None else _int32(meta.launch_order), kv_scale=kv_scale,
            out=out, quantize=quantize)

    def _split(self, meta: AttentionMetadata):
        """((block tables, context lens, query_start_loc) of meta's d = num_leading_decodes decodes, the same of
        the rest, its query_start_loc shifted to start at 0): made once per step (meta) for all its layers."""
        if self._split_meta is None or self._split_meta[0] is not meta:
            d = meta.num_leading_decodes
            tables, lens = _int32(meta.block_tables), _int32(meta.context_lens)
            starts = _int32(meta.query_start_loc)
            self._split_meta = (meta, (tables[:d], lens[:d], starts[:d + 1]), (tables[d:], lens[d:], starts[d:] - d))
        return self._split_meta[1:]

    def logits(self, hidden, lm_head):
        """hidden [K, E] @ lm_head [E, V] -> [K, V] float32: for fp16 and bf16 the GEMM writes its fp32
        accumulator (no rounding of the logits to fp16/bf16 first); other dtypes matmul, then cast.
        The GEMM runs on logits_rows(K) rows (the rest of the rows unset; GEMM rows are independent) and
        the first K come back: cuBLAS blocks the host until the device is idle whenever a shape needs a
        kernel it has not loaded yet (measured on the H200: a 20 ms wait behind a queued 20 ms kernel), which
        a new K per step did in every prefilling step. `warm_logits` loads each bucket's kernel up front."""
        if hidden.dtype != lm_head.dtype or hidden.dtype not in launchers.ELEMENT_SUFFIX:
            return (hidden @ lm_head).astype(cupy.float32)
        if self._logits_gemm is None:
            from offline_paged.ops.graphs import CublasGemm

            self._logits_gemm = CublasGemm(cupy.cuda.Stream.null)  # the eager steps' stream
        num_rows = hidden.shape[0]
        rows = logits_rows(num_rows)
        if rows != num_rows:
            padded = cupy.empty((rows, hidden.shape[1]), dtype=hidden.dtype)  # [R, E]
            padded[:num_rows] = hidden
            hidden = padded
        return self._logits_gemm(cupy.ascontiguousarray(hidden), lm_head, out_dtype=np.float32)[:num_rows]

    def warm_logits(self, lm_head, max_rows: int) -> None:
        """Run the LM head once at every logits_rows bucket up to max_rows (engine start), so that no step
        of a run waits for cuBLAS to load a kernel (see `logits`)."""
        for rows in logits_buckets(max_rows):
            self.logits(cupy.zeros((rows, lm_head.shape[0]), dtype=lm_head.dtype), lm_head)

    def add_bias(self, x, bias):
        """x + bias over the last axis; may update x in place (x [T, N], bias [N])."""
        return launchers.add_bias(cupy.ascontiguousarray(x), bias)

    def silu_mul(self, gate_up, feeds=None):
        """silu(gate) * up for gate_up = concat(gate, up); [T, 2I] -> [T, I]; into an FP8 `feeds` as rms_norm."""
        if _takes_fp8_rows(feeds):
            if isinstance(gate_up, Fp8Product):
                xq, scales = launchers.silu_mul_fp8(None, feeds.weight.shape[1], feeds.input_scale,
                                                    product=gate_up.args, dtype=gate_up.dtype)
            else:
                xq, scales = launchers.silu_mul_fp8(cupy.ascontiguousarray(gate_up), feeds.weight.shape[1],
                                                    feeds.input_scale)
            return Fp8Rows(xq, scales, gate_up.shape[1] // 2, gate_up.dtype)
        gate_up = gate_up.materialize() if isinstance(gate_up, Fp8Product) else cupy.ascontiguousarray(gate_up)
        return launchers.silu_mul(gate_up)

    def deferred(self, linear):
        """`linear` in the form whose product may come back before its scale epilogue (an FP8 layer, fusion on:
        an Fp8Product, which only rms_norm and silu_mul read); any other linear as it is. For outputs that go
        only into those two."""
        if not _takes_fp8_rows(linear):
            return linear
        twin = self._deferred.get(id(linear))
        if twin is None or twin[0] is not linear:
            twin = (linear, dataclasses.replace(linear, deferred=True))
            self._deferred[id(linear)] = twin
        return twin[1]

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


def _takes_fp8_rows(linear) -> bool:
    """Whether the kernel that makes `linear`'s input should quantize it for it (an FP8 layer, fusion on)."""
    return cuda_fp8_linear.FUSED_FP8_INPUTS and isinstance(linear, CudaFp8Linear)


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (no host synchronisation allowed then)."""
    return cupy.cuda.runtime.streamIsCapturing(cupy.cuda.get_current_stream().ptr) != 0
