"""Thin typed launchers: one per CUDA kernel. Each checks dtypes, contiguity and shapes, raises ValueError
saying what is wrong, then launches on the current CuPy stream. No launcher synchronises.

Element types: float16 and bfloat16 (ml_dtypes.bfloat16 arrays, which CuPy 14 handles natively). Every
kernel with typed arithmetic exists once per type (name suffix _f16 / _bf16, see ELEMENT_SUFFIX); the
launchers pick it from the activations' dtype and require every other tensor to match it.
FP8 KV cache: a uint8 pool (FP8_STORAGE: the e4m3fn bits; CuPy has no float8 type) selects the _fp8
kernels of the KV write, rope_write_kv and attention, which then take `kv_scale`, a [2] float32 device
array (k_scale, v_scale) read by the kernels at launch, so a captured CUDA graph replays whatever it holds.

Legend: T tokens, S sequences, H query heads, Hkv KV heads, D head dim, N blocks, B block size,
M max blocks per sequence, E hidden size, I intermediate size, L layers, P pairs / positions.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np

from offline_paged.ops.kernel_modules import kernel
from offline_paged.ops.kv_scales import FP8_STORAGE_CUDA as FP8_STORAGE  # an FP8 pool's element type (uint8)

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # fp16 still works; a bfloat16 array cannot exist without ml_dtypes anyway
    BFLOAT16 = None

HEAD_DIMS = (64, 128)  # what the attention kernel is instantiated for
# Kernel-name suffix per element type (the .cu sources instantiate each typed kernel for both).
ELEMENT_SUFFIX = {np.dtype(np.float16): "f16"} | ({BFLOAT16: "bf16"} if BFLOAT16 is not None else {})
# Every (source, entry point) these launchers may launch: tests/test_cuda_compile.py checks each is
# defined in its compiled source, and _kernel refuses to launch anything not listed here.
KERNELS = (
    ("attention.cu", "paged_attention_d64_keysplit_f16"), ("attention.cu", "paged_attention_d64_rowsplit_f16"),
    ("attention.cu", "paged_attention_d128_keysplit_f16"), ("attention.cu", "paged_attention_d128_rowsplit_f16"),
    ("attention.cu", "merge_partials_f16"),
    ("layer.cu", "rms_norm_f16"), ("layer.cu", "rope_same_cache_f16"), ("layer.cu", "rope_f32_cache_f16"),
    ("layer.cu", "rope_write_kv_same_cache_f16"), ("layer.cu", "rope_write_kv_f32_cache_f16"),
    ("layer.cu", "silu_mul_f16"), ("layer.cu", "add_bias_f16"),
    ("attention.cu", "paged_attention_d64_keysplit_bf16"), ("attention.cu", "paged_attention_d64_rowsplit_bf16"),
    ("attention.cu", "paged_attention_d128_keysplit_bf16"), ("attention.cu", "paged_attention_d128_rowsplit_bf16"),
    ("attention.cu", "merge_partials_bf16"),
    ("layer.cu", "rms_norm_bf16"), ("layer.cu", "rope_same_cache_bf16"), ("layer.cu", "rope_f32_cache_bf16"),
    ("layer.cu", "rope_write_kv_same_cache_bf16"), ("layer.cu", "rope_write_kv_f32_cache_bf16"),
    ("layer.cu", "silu_mul_bf16"), ("layer.cu", "add_bias_bf16"),
    ("cache.cu", "write_kv"), ("cache.cu", "copy_blocks"),
    ("prefill_attention.cu", "prefill_attention_d64_f16"), ("prefill_attention.cu", "prefill_attention_d128_f16"),
    ("prefill_attention.cu", "prefill_attention_d64_bf16"), ("prefill_attention.cu", "prefill_attention_d128_bf16"),
    # The FP8 KV cache's kernels (uint8 pools of e4m3 bits, device scales):
    ("attention.cu", "paged_attention_d64_keysplit_f16_fp8"), ("attention.cu", "paged_attention_d64_rowsplit_f16_fp8"),
    ("attention.cu", "paged_attention_d128_keysplit_f16_fp8"), ("attention.cu", "paged_attention_d128_rowsplit_f16_fp8"),
    ("prefill_attention.cu", "prefill_attention_d64_f16_fp8"), ("prefill_attention.cu", "prefill_attention_d128_f16_fp8"),
    ("layer.cu", "rope_write_kv_fp8_same_cache_f16"), ("layer.cu", "rope_write_kv_fp8_f32_cache_f16"),
    ("attention.cu", "paged_attention_d64_keysplit_bf16_fp8"), ("attention.cu", "paged_attention_d64_rowsplit_bf16_fp8"),
    ("attention.cu", "paged_attention_d128_keysplit_bf16_fp8"), ("attention.cu", "paged_attention_d128_rowsplit_bf16_fp8"),
    ("prefill_attention.cu", "prefill_attention_d64_bf16_fp8"), ("prefill_attention.cu", "prefill_attention_d128_bf16_fp8"),
    ("layer.cu", "rope_write_kv_fp8_same_cache_bf16"), ("layer.cu", "rope_write_kv_fp8_f32_cache_bf16"),
    ("cache.cu", "write_kv_fp8_f16"), ("cache.cu", "write_kv_fp8_bf16"),
    # Decode tiles of at most 8 rows (rows as the mma's N dimension), 16-bit and FP8 caches:
    ("attention.cu", "paged_attention_d64_decode_f16"), ("attention.cu", "paged_attention_d128_decode_f16"),
    ("attention.cu", "paged_attention_d64_decode_bf16"), ("attention.cu", "paged_attention_d128_decode_bf16"),
    ("attention.cu", "paged_attention_d64_decode_f16_fp8"), ("attention.cu", "paged_attention_d128_decode_f16_fp8"),
    ("attention.cu", "paged_attention_d64_decode_bf16_fp8"), ("attention.cu", "paged_attention_d128_decode_bf16_fp8"),
    # FP8 linears' inputs quantized where they are made (rms_norm, silu_mul):
    ("layer.cu", "rms_norm_fp8_f16"), ("layer.cu", "rms_norm_fp8_bf16"),
    ("layer.cu", "silu_mul_fp8_f16"), ("layer.cu", "silu_mul_fp8_bf16"),
    # ... reading an FP8 GEMM's product before its scale epilogue (the epilogue folded in):
    ("layer.cu", "rms_norm_fp8_product_f16"), ("layer.cu", "rms_norm_fp8_product_bf16"),
    ("layer.cu", "silu_mul_fp8_product_f16"), ("layer.cu", "silu_mul_fp8_product_bf16"),
    ("layer.cu", "rms_norm_fp8_product_bf16acc_f16"), ("layer.cu", "rms_norm_fp8_product_bf16acc_bf16"),
    ("layer.cu", "silu_mul_fp8_product_bf16acc_f16"), ("layer.cu", "silu_mul_fp8_product_bf16acc_bf16"),
    # rope_write_kv reading the qkv projection's FP8 product (its scale epilogue folded in), 16-bit and FP8 caches:
    ("layer.cu", "rope_write_kv_product_f16"), ("layer.cu", "rope_write_kv_product_bf16"),
    ("layer.cu", "rope_write_kv_product_bf16acc_f16"), ("layer.cu", "rope_write_kv_product_bf16acc_bf16"),
    ("layer.cu", "rope_write_kv_fp8_product_f16"), ("layer.cu", "rope_write_kv_fp8_product_bf16"),
    ("layer.cu", "rope_write_kv_fp8_product_bf16acc_f16"), ("layer.cu", "rope_write_kv_fp8_product_bf16acc_bf16"),
    # Qwen3's per-head q_norm and k_norm in one launch:
    ("layer.cu", "head_rms_norm_f16"), ("layer.cu", "head_rms_norm_bf16"),
)
ROWS_PER_TILE = 16  # (query token, head) rows per warp tile; see attention.cu
DECODE_TILE_ROWS = 8  # the same for the "decode" kernels (attention.cu's NarrowTile)
WARPS = 4
# Slots of attention.cu's cp.async rings (copies of its constants; 0: K/V through registers instead):
DECODE_RING_STAGES = 3  # decode (key-split) CTAs at head dim 64, a ring per warp
DECODE_RING_STAGES_FP8 = 3  # the same over an FP8 cache (its pieces fill half of each 16-byte slot)
FP8_WIDE_DECODE = 1  # the 8-row decode tiles over an FP8 cache load 16 bytes, through a dense ring:
DECODE_RING_STAGES_DENSE = 3  # its slots (one byte per element)
FP8_DECODE_D128_RING = 1  # the dense ring at head dim 128 too (0: registers there)
PREFILL_RING_STAGES = 2  # row-split CTAs, one ring shared by the 4 warps
KEYS_PER_ROUND = 64  # keys the 4 warps of a CTA consume per round: partitions are multiples of this
CHUNK_KEYS = KEYS_PER_ROUND // WARPS  # keys one warp consumes per step (attention.cu's CHUNK)
# prefill_attention.cu (the FlashAttention-2-style kernel of long query chunks), copies of its constants:
PREFILL_TILE_ROWS = 128  # (query token, head) rows per CTA: 8 warps x 16
PREFILL_TILE_KEYS = 64  # keys per K/V tile (a multiple of it is every split's partition)
PREFILL_STAGES = 3  # cp.async stages of K/V tiles (two in flight): they size its dynamic shared memory
PREFILL_THREADS = 256
MAX_GRID_Y_TILES = 65535  # its row tiles run along gridDim.y
# Which kernel paged_attention launches (None: it decides per call, see choose_attention_kernel):
ATTENTION_KERNELS = ("decode", "keysplit", "rowsplit", "prefill")
MIN_PARTITION = 256  # shortest key range worth a split of its own
# CTAs per SM the key splits aim for: the "decode" tiles stop at 2, the other kernels at 4. Measured on the H200
# (session 36, decode graph launches, contexts 600..1900): 4 over-split the decode tiles at 16-64 sequences, e.g.
# Qwen3-0.6B at 32 sequences 64.5 us with 3 splits against 57.2 with 2, at 64 sequences 96.5 with 2 against 88.7
# with 1 (the partial writes, their merge and its memset cost more than the extra CTAs bring).
SPLIT_CTAS_PER_SM = 4
DECODE_SPLIT_CTAS_PER_SM = 2
MAX_PARTIAL_BYTES = 256 << 20  # cap on the fp32 split workspace
VECTOR_WIDTH = 8  # 16-bit elements per 16-byte access in layer.cu's vector paths
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (silu_mul's row dimension; the kernel strides past it)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_array(name: str, a, dtype, ndim: int, contiguous: bool = True) -> None:
    """Messages are formatted only on failure (eager steps check a few arrays per kernel launch)."""
    if not isinstance(a, cupy.ndarray):
        raise ValueError(f"{name} must be a cupy.ndarray, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype.name}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {a.shape}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {a.shape}, strides {a.strides})")


def _element_suffix(name: str, a) -> str:
    """Kernel suffix for the element type of `a` (the activations): "f16" or "bf16"; ValueError else."""
    _require(isinstance(a, cupy.ndarray), f"{name} must be a cupy.ndarray, got {type(a).__name__}")
    suffix = ELEMENT_SUFFIX.get(np.dtype(a.dtype))
    _require(suffix is not None, f"{name} must be float16 or bfloat16, got {a.dtype.name}")
    return suffix


def _check_rows(name: str, a, ndim: int, dtype=np.float16) -> int:
    """`dtype` array whose dims after the first are contiguous and whose rows start 16-byte aligned.
    Returns the row stride in elements."""
    _check_array(name, a, dtype, ndim, contiguous=False)
    if a.size:
        _require(a[0].flags.c_contiguous, f"{name}: all dims but the first must be contiguous "
                                          f"(shape {a.shape}, strides {a.strides})")
    _require(a.strides[0] % 16 == 0 and a.data.ptr % 16 == 0,
             f"{name}: rows must start on 16-byte boundaries (strides {a.strides})")
    return a.strides[0] // a.itemsize


def _cache_is_fp8(k_cache, kv_scale) -> bool:
    """Whether k_cache is an FP8 pool (uint8; then kv_scale must be a [2] float32 device array) rather than
    one of the activations' type (then kv_scale must be None; the caller checks the type)."""
    _require(isinstance(k_cache, cupy.ndarray), f"k_cache must be a cupy.ndarray, got {type(k_cache).__name__}")
    if k_cache.dtype != FP8_STORAGE:
        _require(kv_scale is None, "kv_scale is only for an FP8 (uint8) KV cache")
        return False
    _check_array("kv_scale", kv_scale, np.float32, 1)
    _require(kv_scale.shape[0] == 2, f"kv_scale must hold (k_scale, v_scale), got shape {kv_scale.shape}")
    return True


def _vector_path(width: int, *arrays) -> bool:
    """Whether layer.cu takes its 16-byte path: rows of `width` elements split into 8-element chunks and
    every array starts 16-byte aligned (the kernels test the same condition themselves)."""
    return width % VECTOR_WIDTH == 0 and all(a.data.ptr % 16 == 0 for a in arrays if a is not None)


def _block_threads(units: int, cap: int) -> int:
    """Threads per block for `units` work items a block strides over: a multiple of 32, at most cap."""
    return min(cap, max(32, math.ceil(units / 32) * 32))


@functools.cache
def _num_sms() -> int:
    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def _kernel(filename: str, name: str):
    if (filename, name) not in KERNELS:
        raise RuntimeError(f"{filename}:{name} is not declared in launchers.KERNELS")
    return kernel(filename, name)


def plan_splits(num_ctas: int, max_context_len: int, partial_row_bytes: int,
                ctas_per_sm: int = SPLIT_CTAS_PER_SM) -> tuple[int, int]:
    """(num_splits, partition_size) for the key dimension: split until the grid has ~ctas_per_sm CTAs per SM,
    never into ranges shorter than MIN_PARTITION keys, within the workspace cap."""
    splits = 1
    target = ctas_per_sm * _num_sms()
    if num_ctas < target and max_context_len > MIN_PARTITION:
        splits = min(math.ceil(target / max(num_ctas, 1)), math.ceil(max_context_len / MIN_PARTITION))
        splits = max(1, min(splits, MAX_PARTIAL_BYTES // max(partial_row_bytes, 1)))
    partition = math.ceil(max(max_context_len, 1) / splits / KEYS_PER_ROUND) * KEYS_PER_ROUND
    return math.ceil(max(max_context_len, 1) / partition), partition


def key_span(max_context_len: int, window: int, rows_per_range: int = ROWS_PER_TILE) -> int:
    """Most keys the splits of one key range must cover. A CTA reads the keys of `rows_per_range` rows
    (one row tile; WARPS tiles when a row-split CTA shares its ring). Without a window, the context. With
    one, the range starts at its first row's window start rounded down to KEYS_PER_ROUND, and its rows span
    at most rows_per_range positions: window + rows_per_range - 1 keys plus up to KEYS_PER_ROUND - 1."""
    if window <= 0:
        return max_context_len
    return min(max_context_len, window + rows_per_range - 1 + KEYS_PER_ROUND - 1)


def choose_attention_kernel(max_query_len: int, group: int) -> str:
    """The kernel paged_attention runs when the caller names none: "prefill" (prefill_attention.cu) once
    the longest query fills a 128-row tile, else attention.cu's "rowsplit" (4 warp tiles of 16 rows per CTA)
    from 64 rows, "keysplit" below (the warps share one row tile of 16 and split its keys) and "decode" up to
    8 rows (the same with tiles of 8 rows as the mma's N dimension: one decode token's heads of a KV head)."""
    rows = max_query_len * group
    if rows >= PREFILL_TILE_ROWS:
        return "prefill"
    if rows >= ROWS_PER_TILE * WARPS:
        return "rowsplit"
    return "keysplit" if rows > DECODE_TILE_ROWS else "decode"


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                    max_query_len: int, max_context_len: int, scale: float, num_splits: int | None = None,
                    window: int = 0, zero_fill: bool = True, launch_order=None, kernel: str | None = None,
                    kv_scale=None, out=None, quantize=None):
    """Causal GQA attention of q [T, H, D] against paged K/V [N, B, Hkv, D]; returns out [T, H, D].

    Sequence s owns q rows query_start_loc[s]:query_start_loc[s+1] and has context_lens[s] cached tokens
    (its queries are the last ones); rows of no sequence come back as zeros. max_query_len and
    max_context_len must bound the metadata (keys past the planned splits would be skipped).
    window > 0: sliding window, a query at position p sees keys p - window < k <= p only, and no key
    before its window is read (those blocks may be freed). num_splits forces a split count (tests);
    None plans one. q, k_cache and v_cache are float16 or bfloat16, all the same. zero_fill=False skips
    zeroing the output first (a memset per call): only for callers whose every q row belongs to a sequence
    (query_start_loc[S] == T), else the rows of no sequence come back uninitialised. launch_order [S] int32:
    a permutation of the sequences, run in that order (longest first balances the last wave of CTAs;
    step_inputs_launcher.launch_order computes it on the device); None runs them in index order. It changes
    the speed only, never the result. kernel: one of ATTENTION_KERNELS to force (tests, benchmarks); None
    lets choose_attention_kernel pick by the longest query. Every kernel gives the same result up to
    rounding; the semantics above hold for each. FP8 KV cache: k_cache / v_cache uint8 (e4m3fn bits) and
    kv_scale [2] float32 on the device; attention reads cached K x k_scale and cached V x v_scale.
    out: a C-contiguous array like q to write into and return (the mixed-step graphs' persistent buffer); None:
    a new one.
    quantize = (padded_width, static_scale), either None for the default: out's token rows [T, H D] go into an FP8
    linear, and (out, xq [T, Kp] uint8, scales [T] float32) comes back, byte for byte
    fp8_launcher.quantize_rows_fp8(out.reshape(T, H D), padded_width, static_scale). The attention kernel quantizes
    them itself (each token's last CTA to finish, attention.cu's quantize_token_row) where FUSED_ATTENTION_QUANTIZE is
    on, every sequence has one query token, every row belongs to a sequence (zero_fill False) and one key split covers
    the keys: a decode step's launch, as the decode graphs make it. Elsewhere a quantize_rows_fp8 launch after it does.
    """
    suffix = _element_suffix("q", q)
    fp8 = _cache_is_fp8(k_cache, kv_scale)
    _check_array("q", q, q.dtype, 3)
    _check_array("k_cache", k_cache, FP8_STORAGE if fp8 else q.dtype, 4)
    _check_array("v_cache", v_cache, FP8_STORAGE if fp8 else q.dtype, 4)
    _check_array("block_tables", block_tables, np.int32, 2)
    _check_array("context_lens", context_lens, np.int32, 1)
    _check_array("query_start_loc", query_start_loc, np.int32, 1)
    if launch_order is not None:
        _check_array("launch_order", launch_order, np.int32, 1)
    if out is not None:
        _check_array("out", out, q.dtype, 3)
        if out.shape != q.shape:
            raise ValueError(f"out shape {out.shape} != q shape {q.shape}")
    if not (isinstance(window, (int, np.integer)) and 0 <= window < 2**30):  # (formatted only on failure)
        raise ValueError(f"window must be an integer in [0, 2**30) (0 = no sliding window), got {window!r}")
    plan = _plan_attention(q.shape, k_cache.shape, v_cache.shape, block_tables.shape, context_lens.shape[0],
                           query_start_loc.shape[0], None if launch_order is None else launch_order.shape[0],
                           int(max_query_len), int(max_context_len), num_splits, int(window), kernel, suffix, fp8)
    if plan is None:
        out = cupy.zeros(q.shape, dtype=q.dtype) if out is None else _zeroed(out)
        if quantize is None:
            return out
        rows = _quantized_rows(q, quantize)
        _quantize_rows_after(out, quantize, rows)
        return (out, *rows)
    # One split writes rows in place (rows of no sequence must read 0); with several, the merge writes all.
    if out is None:
        out = cupy.empty(q.shape, dtype=q.dtype)
    if plan.num_splits == 1 and zero_fill:
        _zeroed(out)
    if plan.num_splits > 1:
        partial_o = cupy.empty((plan.num_splits, *q.shape), dtype=cupy.float32)  # [splits, T, H, D]
        partial_ml = cupy.zeros((plan.num_splits, *q.shape[:2], 2), dtype=cupy.float32)  # [splits, T, H, 2]
    else:
        partial_o = partial_ml = out  # never read or written with one split
    rows = _quantized_rows(q, quantize) if quantize is not None else None
    row_sync = (_row_sync(q.shape[0]) if rows is not None and FUSED_ATTENTION_QUANTIZE and plan.quantizes
                and plan.num_splits == 1 and int(max_query_len) == 1 and not zero_fill else None)
    fused = (_NOT_QUANTIZED if row_sync is None else
             (rows[0], rows[1], row_sync, np.int32(rows[0].shape[1]), np.float32(quantize[1] or 0.0)))
    plan.function(plan.grid, (plan.threads,),
                  (q, k_cache, v_cache, out, partial_o, partial_ml, block_tables, context_lens, query_start_loc,
                   np.uint64(0) if launch_order is None else launch_order,  # a null pointer: index order
                   *plan.sizes, np.float32(scale * LOG2_E), *plan.tail, *((kv_scale,) if fp8 else ()),
                   *fused),
                  shared_mem=plan.shared_bytes)
    if plan.num_splits > 1:
        plan.merge((plan.merge_rows,), (q.shape[2],), (partial_o, partial_ml, out, *plan.merge_sizes))
    if rows is None:
        return out
    if row_sync is None:
        _quantize_rows_after(out, quantize, rows)
    return (out, *rows)


# True: attention's decode launches quantize their output for an FP8 linear themselves when asked (`quantize`); False
# (the default): a quantize_rows_fp8 launch after each (the same bytes). Off because it lost in the one pair measured
# (session 57, 8B FP8 w + KV, H100): decode steps 7.99 ms fused against 7.81 ms, while the prefill steps, which it does
# not touch, took the same time (113.7 / 113.6 ms); benchmarks/NOTES.md has the caveats and why it may lose.
# -DATTENTION_QUANTIZES=0 in kernel_modules.COMPILE_OPTIONS compiles the kernels' tail out.
FUSED_ATTENTION_QUANTIZE = False
ROW_SYNC_TOKENS = 16384  # tokens a fused launch may have (more: the quantize launch after it)
_NOT_QUANTIZED = (np.uint64(0), np.uint64(0), np.uint64(0), np.int32(0), np.float32(0.0))
_row_sync_buffers: dict[int, Any] = {}  # device id -> [ROW_SYNC_TOKENS, 2] uint32


def _row_sync(num_tokens: int):
    """The device's [ROW_SYNC_TOKENS, 2] uint32 counters of fused quantizing launches (each token's amax bits and
    CTAs arrived, zero between launches: the last CTA of a token zeroes its pair). Made on first use outside a graph
    capture, then kept for good (captured graphs hold its address); None where it cannot serve (too many tokens, or
    not made yet while the stream captures): the caller then quantizes after the launch."""
    if num_tokens > ROW_SYNC_TOKENS:
        return None
    device = cupy.cuda.Device().id
    buffer = _row_sync_buffers.get(device)
    if buffer is None:
        stream = cupy.cuda.get_current_stream()
        if cupy.cuda.runtime.streamIsCapturing(stream.ptr):
            return None
        buffer = cupy.zeros((ROW_SYNC_TOKENS, 2), dtype=cupy.uint32)
        stream.synchronize()  # zeroed before any stream's launch reads it
        _row_sync_buffers[device] = buffer
    return buffer


def _quantized_rows(q, quantize) -> tuple:
    """(xq [T, Kp] uint8, scales [T] float32) to hold q's shape of attention output quantized by `quantize`."""
    _require(isinstance(quantize, tuple) and len(quantize) == 2, "quantize must be (padded_width, static_scale)")
    padded_width, static_scale = quantize
    return fp8_rows(q.shape[0], q.shape[1] * q.shape[2], padded_width, static_scale)


def _quantize_rows_after(out, quantize, rows) -> None:
    """out's token rows quantized into rows = (xq, scales) by a quantize_rows_fp8 launch."""
    from offline_paged.ops.fp8_launcher import quantize_rows_fp8  # (it imports this module)

    quantize_rows_fp8(out.reshape(out.shape[0], -1), rows[0].shape[1], quantize[1], xq=rows[0], scales=rows[1])


LOG2_E = math.log2(math.e)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """What paged_attention launches for one set of shapes and bounds: the kernel and its merge, the grid, the
    key splits and the launch's integer arguments. The same for every layer of a step, so it is planned once
    (`_plan_attention` is cached) and each layer only launches."""

    function: Any  # the attention kernel (its dynamic shared memory allowed)
    merge: Any  # merge_partials of the element type
    grid: tuple[int, int, int]
    threads: int
    shared_bytes: int
    num_splits: int
    sizes: tuple  # int32 (num_tokens, num_kv_heads, group, block_size, table width, partition, num_splits)
    tail: tuple  # int32 (log2 of block_size or -1, window)
    merge_rows: int  # T x H
    merge_sizes: tuple  # int32 (num_splits, T x H, D)
    quantizes: bool  # the kernel can quantize its output rows (decode, keysplit: one token's rows per CTA)


def clear_plans() -> None:
    """Forget the cached attention plans: after a change to the kernels' sources or to the stage constants that
    size their shared memory (benchmarks comparing variants in one process; with kernel_modules.clear_cache)."""
    _plan_attention.cache_clear()


@functools.lru_cache(maxsize=512)
def _plan_attention(q_shape, k_shape, v_shape, table_shape, num_seqs: int, num_starts: int, num_ordered,
                    max_query_len: int, max_context_len: int, num_splits, window: int, kernel, suffix: str,
                    fp8: bool) -> AttentionPlan | None:
    """paged_attention's checks of shapes and bounds and its plan (None: nothing to compute, zeros)."""
    num_tokens, num_heads, head_dim = q_shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_shape
    _require(v_shape == k_shape, f"v_cache shape {v_shape} != k_cache shape {k_shape}")
    _require(head_dim == cache_dim, f"q head dim {head_dim} != cache head dim {cache_dim}")
    _require(head_dim in HEAD_DIMS, f"head dim {head_dim} not supported (kernels exist for {HEAD_DIMS})")
    _require(num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    _require(table_shape[0] == num_seqs, f"block_tables has {table_shape[0]} rows for {num_seqs} sequences")
    _require(num_starts == num_seqs + 1, f"query_start_loc must have {num_seqs + 1} entries, got {num_starts}")
    _require(num_ordered is None or num_ordered == num_seqs,
             f"launch_order must have {num_seqs} entries (one per sequence), got {num_ordered}")
    _require(max_query_len >= 0 and max_context_len >= 0, "max_query_len / max_context_len must be >= 0")
    _require(kernel is None or kernel in ATTENTION_KERNELS,
             f"kernel must be None or one of {ATTENTION_KERNELS}, got {kernel!r}")
    if num_seqs == 0 or num_tokens == 0 or max_query_len == 0:
        return None
    group = num_heads // num_kv_heads
    kernel = kernel or choose_attention_kernel(max_query_len, group)
    launch = _attention_launch(kernel, head_dim, max_query_len * group, suffix, fp8)
    span = key_span(max_context_len, window, launch.rows_per_range)
    if num_splits is None:
        num_splits, partition = plan_splits(num_seqs * num_kv_heads * launch.row_tiles, span,
                                            num_tokens * num_heads * head_dim * 4,
                                            DECODE_SPLIT_CTAS_PER_SM if kernel == "decode" else SPLIT_CTAS_PER_SM)
    else:
        partition = math.ceil(max(span, 1) / num_splits / KEYS_PER_ROUND) * KEYS_PER_ROUND
    heads_and_splits = num_kv_heads * num_splits
    grid = ((heads_and_splits, launch.row_tiles, num_seqs) if kernel == "prefill"
            else (launch.row_tiles, heads_and_splits, num_seqs))
    _require(grid[1] <= MAX_GRID_Y_TILES, f"{grid[1]} row tiles or kv heads x splits exceed the grid's y limit")
    sizes = (num_tokens, num_kv_heads, group, block_size, table_shape[1], partition, num_splits)
    shift = block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1
    return AttentionPlan(
        function=_shared_memory_kernel(launch.source, launch.name, launch.shared_bytes),
        merge=_kernel("attention.cu", f"merge_partials_{suffix}"), grid=grid, threads=launch.threads,
        shared_bytes=launch.shared_bytes, num_splits=num_splits, sizes=tuple(np.int32(v) for v in sizes),
        tail=(np.int32(shift), np.int32(window)), merge_rows=num_tokens * num_heads,
        merge_sizes=(np.int32(num_splits), np.int32(num_tokens * num_heads), np.int32(head_dim)),
        quantizes=kernel in ("decode", "keysplit"))


def _zeroed(array):
    """`array` filled with zeros in place (a memset on the current stream)."""
    array.fill(0)
    return array


@dataclass(frozen=True, slots=True)
class AttentionLaunch:
    """How one attention kernel is launched: its entry point, CTA shape and shared memory, the row tiles
    its grid holds per (sequence, kv head) and the rows whose keys one CTA reads (key_span's bound)."""

    source: str
    name: str
    threads: int
    shared_bytes: int
    row_tiles: int
    rows_per_range: int


def _attention_launch(kernel: str, head_dim: int, max_rows: int, suffix: str, fp8: bool) -> AttentionLaunch:
    """The launch of `kernel` (one of ATTENTION_KERNELS) for sequences of at most max_rows (query token, head)
    rows of element type `suffix`, over an FP8 cache or a 16-bit one."""
    name_suffix = f"{suffix}_fp8" if fp8 else suffix
    if kernel == "prefill":
        return AttentionLaunch("prefill_attention.cu", f"prefill_attention_d{head_dim}_{name_suffix}",
                               PREFILL_THREADS, prefill_shared_bytes(head_dim),
                               math.ceil(max_rows / PREFILL_TILE_ROWS), PREFILL_TILE_ROWS)
    row_split = kernel == "rowsplit"
    tile_rows = DECODE_TILE_ROWS if kernel == "decode" else ROWS_PER_TILE
    tiles = math.ceil(max_rows / tile_rows)
    shared_range = row_split and PREFILL_RING_STAGES > 0  # the CTA's 4 tiles read one key range
    return AttentionLaunch("attention.cu", f"paged_attention_d{head_dim}_{kernel}_{name_suffix}", WARPS * 32,
                           ring_bytes(head_dim, row_split, fp8, narrow=kernel == "decode"),
                           math.ceil(tiles / WARPS) if row_split else tiles,
                           tile_rows * (WARPS if shared_range else 1))


def prefill_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of prefill_attention.cu: PREFILL_STAGES tiles of 64 keys of K and V."""
    return PREFILL_STAGES * 2 * PREFILL_TILE_KEYS * head_dim * 2  # 2 bytes per element


def ring_bytes(head_dim: int, row_split: bool, fp8: bool = False, narrow: bool = False) -> int:
    """Dynamic shared memory of an attention.cu launch: the cp.async ring, WARPS x stages chunks of 16 keys
    of K and V, for row-split CTAs and for decode (key-split) CTAs at head dim 64 (fp8: over an FP8 cache,
    whose ring keeps the 16-bit layout, except the dense ring of the 8-row `narrow` decode tiles); 0 where the
    kernel keeps K/V in registers."""
    dense = fp8 and narrow and FP8_WIDE_DECODE and not row_split
    decode_stages = DECODE_RING_STAGES_DENSE if dense else DECODE_RING_STAGES_FP8 if fp8 else DECODE_RING_STAGES
    ring_dims = (64, 128) if dense and FP8_DECODE_D128_RING else (64,)
    stages = PREFILL_RING_STAGES if row_split else decode_stages if head_dim in ring_dims else 0
    return WARPS * stages * 2 * CHUNK_KEYS * head_dim * (1 if dense else 2)  # bytes per element


def _shared_memory_kernel(source: str, name: str, shared_bytes: int):
    """The kernel, allowed `shared_bytes` of dynamic shared memory (past 48 KiB needs the opt-in
    attribute: raised the first time a launch asks for more than the kernel allows)."""
    k = _kernel(source, name)
    if shared_bytes > k.max_dynamic_shared_size_bytes:
        k.max_dynamic_shared_size_bytes = shared_bytes
    return k


def _check_kv_write(k, v, k_cache, v_cache, slot_mapping) -> int:
    """The checks a K/V cache write needs (k's own rows checked by the caller); returns v's row stride.
    v has k's dtype; the caches k's dtype too, or both uint8 (FP8)."""
    v_stride = _check_rows("v", v, 3, k.dtype)
    _check_array("k_cache", k_cache, k_cache.dtype, 4)
    _check_array("v_cache", v_cache, k_cache.dtype, 4)
    _check_array("slot_mapping", slot_mapping, np.int32, 1)
    _require(k.shape == v.shape, f"k shape {k.shape} != v shape {v.shape}")
    _require(k_cache.shape == v_cache.shape, f"k_cache shape {k_cache.shape} != v_cache shape {v_cache.shape}")
    _require(k.shape[1:] == k_cache.shape[2:], f"k rows {k.shape[1:]} do not match cache rows {k_cache.shape[2:]}")
    _require(slot_mapping.shape[0] == k.shape[0], f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    return v_stride


def write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scale=None) -> None:
    """k_cache/v_cache row slot_mapping[t] <- k[t] / v[t] ([T, Hkv, D] rows; negative slot = skip).
    float16 or bfloat16, all four the same (the kernel copies bytes); or FP8: k, v float16 / bfloat16, the
    caches uint8 and kv_scale [2] float32 on the device: stored = e4m3(x / scale) (kv_scales.quantize_fp8)."""
    fp8 = _cache_is_fp8(k_cache, kv_scale)
    suffix = _element_suffix("k" if fp8 else "k_cache", k if fp8 else k_cache)
    k_stride = _check_rows("k", k, 3, k.dtype if fp8 else k_cache.dtype)
    v_stride = _check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    row_elems = k.shape[1] * k.shape[2]
    _require(row_elems % 8 == 0, f"Hkv * D = {row_elems} must be a multiple of 8 (16-byte vectors)")
    if k.shape[0] == 0:
        return
    name, scale_args = (f"write_kv_fp8_{suffix}", (kv_scale,)) if fp8 else ("write_kv", ())
    _kernel("cache.cu", name)(
        (k.shape[0],), (min(128, row_elems // 8),),
        (k, v, k_cache, v_cache, slot_mapping, *scale_args, np.int64(k_stride), np.int64(v_stride),
         np.int32(row_elems)))


def copy_blocks(kv_cache, src_ids, dst_ids) -> None:
    """kv_cache[:, :, dst_ids[i]] <- kv_cache[:, :, src_ids[i]] in one launch (float16 or bfloat16, or an
    FP8 pool's uint8, moved as 2-byte units). No dst may also be a src (checked by the caller, who has the
    ids on the host)."""
    if isinstance(kv_cache, cupy.ndarray) and kv_cache.dtype == FP8_STORAGE and kv_cache.flags.c_contiguous \
            and kv_cache.ndim == 6 and kv_cache.shape[-1] % 2 == 0:
        kv_cache = kv_cache.view(cupy.uint16)  # [L, 2, N, B, Hkv, D / 2]: the same bytes
    else:
        _element_suffix("kv_cache", kv_cache)
    _check_array("kv_cache", kv_cache, kv_cache.dtype, 6)
    _check_array("src_ids", src_ids, np.int32, 1)
    _check_array("dst_ids", dst_ids, np.int32, 1)
    _require(src_ids.shape == dst_ids.shape, f"{src_ids.shape[0]} src ids but {dst_ids.shape[0]} dst ids")
    num_layers, _, num_blocks = kv_cache.shape[:3]
    block_elems = math.prod(kv_cache.shape[3:])
    _require(block_elems % 8 == 0, f"a block holds {block_elems} elements, not a multiple of 8")
    if src_ids.shape[0] == 0:
        return
    _kernel("cache.cu", "copy_blocks")(
        (src_ids.shape[0], num_layers * 2), (128,),
        (kv_cache, src_ids, dst_ids, np.int64(num_blocks), np.int32(block_elems)))


def rms_norm(x, weight, eps: float, residual=None):
    """(normed [T, E], new residual [T, E]) with vLLM's convention (see NumpyOps.rms_norm).
    float16 or bfloat16; weight and residual of x's dtype."""
    suffix = _element_suffix("x", x)
    _check_array("x", x, x.dtype, 2)
    _check_array("weight", weight, x.dtype, 1)
    _require(weight.shape[0] == x.shape[1], f"weight has {weight.shape[0]} entries for hidden size {x.shape[1]}")
    if residual is not None:
        _check_array("residual", residual, x.dtype, 2)
        _require(residual.shape == x.shape, f"residual shape {residual.shape} != x shape {x.shape}")
    out = cupy.empty_like(x)
    residual_out = cupy.empty_like(x)
    if x.shape[0]:
        hidden = x.shape[1]
        units = hidden // VECTOR_WIDTH if _vector_path(hidden, x, residual, weight, out, residual_out) else hidden
        _kernel("layer.cu", f"rms_norm_{suffix}")(
            (x.shape[0],), (_block_threads(units, 1024),),
            (x, residual if residual is not None else np.uint64(0), weight, out, residual_out,
             np.int32(x.shape[1]), np.float32(eps)))
    return out, residual_out


def head_rms_norm(q, k, q_weight, k_weight, eps: float):
    """Qwen3's q_norm and k_norm in one kernel: new contiguous (q_out [T, H, D], k_out [T, Hkv, D]), every head
    RMS-normed over D and times its weight (rms_norm's arithmetic, each head a row). q, k: float16 or bfloat16
    (row-strided views of one qkv row are fine); q_weight, k_weight [D] of q's dtype."""
    suffix = _element_suffix("q", q)
    q_stride = _check_rows("q", q, 3, q.dtype)
    k_stride = _check_rows("k", k, 3, q.dtype)
    num_tokens, num_heads, head_dim = q.shape
    _require(k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k shape {k.shape} does not fit q shape {q.shape}")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        _check_array(name, weight, q.dtype, 1)
        _require(weight.shape[0] == head_dim, f"{name} has {weight.shape[0]} entries for head dim {head_dim}")
    q_out = cupy.empty(q.shape, dtype=q.dtype)
    k_out = cupy.empty(k.shape, dtype=q.dtype)
    if num_tokens:
        _kernel("layer.cu", f"head_rms_norm_{suffix}")(
            (num_tokens,), (_block_threads(32 * (num_heads + k.shape[1]), 256),),
            (q, k, q_weight, k_weight, q_out, k_out, np.int64(q_stride), np.int64(k_stride), np.int32(num_heads),
             np.int32(k.shape[1]), np.int32(head_dim), np.float32(eps)))
    return q_out, k_out


# rms_norm_fp8 / silu_mul_fp8 run a row per block, its threads over the row's 8-element chunks (the first RMS_HELD /
# SILU_HELD = 4 a thread stay in registers between the amax and the quantize pass). Their ~60 registers a thread let
# two blocks of up to 512 threads share an SM, but only one of 1024: with more rows than SMs (a 256-row decode step),
# silu_mul_fp8's blocks of at most 512 threads run the rows in one wave instead of two; fewer rows spread over up to
# 1024 threads. rms_norm_fp8 keeps rms_norm's threads (its bytes depend on the order of its sum; up to hidden 4096
# that is at most 512 threads anyway).
# (bench_fp8_inputs.py --rows 256, bf16, 2026-12-03: silu_mul_fp8 8B 11.7 us under this rule against 13.9 at 1 chunk
# a thread, 1B 7.7 against 9.9; rms_norm_fp8 is fastest at 1 chunk, which rms_norm's threads give up to hidden 4096.)
# Engine A/B (8B, FP8 weights + KV, bf16, two interleaved pairs in one call, 2026-12-03): 13,625 / 13,616 out tok/s
# under the rule against 13,521 / 13,523 at 1 chunk a thread (+0.7%; forward 9.86 against 9.91 ms).
# A number here forces that many chunks a thread instead (the benchmark's comparison); None takes the rule.
FP8_INPUT_CHUNKS_PER_THREAD: int | None = None
FP8_INPUT_THREADS_MANY_ROWS = 512


def fp8_input_threads(units: int, num_rows: int, num_sms: int, sums: bool = False) -> int:
    """Threads per block of rms_norm_fp8 / silu_mul_fp8 for rows of `units` 8-element chunks (the rule above).
    sums: the kernel sums over its row (rms_norm_fp8), so it keeps rms_norm's threads: the sum of squares then adds
    up in rms_norm's order, and the bytes stay those of rms_norm then quantize. (A max, silu_mul's, has no order.)"""
    if FP8_INPUT_CHUNKS_PER_THREAD is not None:
        return _block_threads(math.ceil(units / FP8_INPUT_CHUNKS_PER_THREAD), 1024)
    return _block_threads(units, FP8_INPUT_THREADS_MANY_ROWS if num_rows > num_sms and not sums else 1024)


FP8_ALIGN = 16  # cuBLASLt's FP8 GEMM: inner dimension and leading dimensions multiples of 16


def fp8_padded(width: int) -> int:
    """`width` rounded up to a multiple of FP8_ALIGN."""
    return -(-width // FP8_ALIGN) * FP8_ALIGN


def fp8_rows(num_rows: int, width: int, padded_width: int | None, static_scale: float | None, xq=None, scales=None):
    """The outputs of an FP8-quantizing kernel: (xq [R, Kp] e4m3 bits, scales [R] float32), allocated unless given,
    after checking padded_width (default `width` rounded up to FP8_ALIGN; a multiple of it, at least `width`:
    cuBLASLt's FP8 rule) and static_scale. A given xq / scales is checked by the caller."""
    padded_width = fp8_padded(width) if padded_width is None else int(padded_width)
    _require(padded_width >= width and padded_width % FP8_ALIGN == 0,
             f"padded_width must be a multiple of {FP8_ALIGN} and >= {width}, got {padded_width}")
    _require(static_scale is None or (math.isfinite(static_scale) and static_scale > 0),
             f"static_scale must be a positive finite number, got {static_scale!r}")
    xq = cupy.empty((num_rows, padded_width), dtype=FP8_STORAGE) if xq is None else xq
    scales = cupy.empty(num_rows, dtype=cupy.float32) if scales is None else scales
    return xq, scales


def rms_norm_fp8(x, weight, eps: float, residual=None, padded_width: int | None = None,
                 static_scale: float | None = None, product=None):
    """rms_norm whose normed output goes straight into an FP8 linear: (xq [T, Kp] uint8 e4m3 bits, scales [T]
    float32, new residual [T, E]), byte for byte rms_norm then fp8_launcher.quantize_rows_fp8(normed,
    padded_width, static_scale) (per row: scale max|normed| / 448, or static_scale). Kp = padded_width (default:
    E rounded up to 16); columns E..Kp-1 of xq are 0.
    product = (acc [T, Np] float32 / bfloat16, acc_x_scale [T], acc_w_scale [Np], E), with x None: x is an FP8
    GEMM's product before its scale epilogue, read in: byte for byte fp8_launcher.scale_fp8_output(acc,
    acc_x_scale, acc_w_scale, E, weight's dtype) first."""
    suffix = _element_suffix("weight", weight)
    _check_array("weight", weight, weight.dtype, 1)
    hidden = weight.shape[0]
    if product is None:
        _check_array("x", x, weight.dtype, 2)
        _require(x.shape[1] == hidden, f"weight has {hidden} entries for hidden size {x.shape[1]}")
        num_tokens, name, x_args = x.shape[0], f"rms_norm_fp8_{suffix}", (x,)
    else:
        num_tokens, width, x_args, acc_tag = _product_args(product)
        _require(width == hidden, f"weight has {hidden} entries for a product {width} wide")
        name = f"rms_norm_fp8_product{acc_tag}_{suffix}"
    if residual is not None:
        _check_array("residual", residual, weight.dtype, 2)
        _require(residual.shape == (num_tokens, hidden),
                 f"residual shape {residual.shape} != x shape {(num_tokens, hidden)}")
    xq, scales = fp8_rows(num_tokens, hidden, padded_width, static_scale)
    padded_width = xq.shape[1]
    residual_out = cupy.empty((num_tokens, hidden), dtype=weight.dtype)
    if num_tokens:
        units = hidden // VECTOR_WIDTH if _vector_path(hidden, residual, weight, residual_out, xq) else hidden
        _kernel("layer.cu", name)(
            (num_tokens,), (fp8_input_threads(units, num_tokens, _num_sms(), sums=True),),
            (*x_args, residual if residual is not None else np.uint64(0), weight, xq, scales, residual_out,
             np.int32(hidden), np.int32(padded_width), np.float32(eps), np.float32(static_scale or 0.0)))
    return xq, scales, residual_out


def _product_args(product) -> tuple:
    """Checks an FP8 GEMM's unscaled product (acc [T, Np] float32 or bfloat16, x_scale [T], w_scale [Np] float32,
    all contiguous on the device; N its width, Np >= N a multiple of 4); returns (T, N, the kernel's product
    arguments, the kernel-name tag of acc's dtype)."""
    _require(isinstance(product, tuple) and len(product) == 4, "product must be (acc, x_scale, w_scale, width)")
    acc, x_scale, w_scale, width = product
    acc_tag = accumulator_tag(acc)
    _check_array("acc", acc, acc.dtype, 2)
    _check_array("x_scale", x_scale, np.float32, 1)
    _check_array("w_scale", w_scale, np.float32, 1)
    num_rows, padded = acc.shape
    _require(padded >= width and padded % 4 == 0, f"acc is {padded} wide: not a multiple of 4 >= {width}")
    _require(x_scale.shape[0] == num_rows and w_scale.shape[0] == padded,
             f"scales of {x_scale.shape[0]} rows and {w_scale.shape[0]} columns for acc {acc.shape}")
    return num_rows, int(width), (acc, x_scale, w_scale, np.int32(padded)), acc_tag


def accumulator_tag(acc) -> str:
    """The kernel-name tag of an FP8 GEMM's accumulator: "" for float32, "_bf16acc" for bfloat16 (its sums rounded
    once by the GEMM; fp8_linear.BF16_PRODUCTS); ValueError for anything else."""
    dtype = np.dtype(getattr(acc, "dtype", np.float64))
    if dtype == np.float32:
        return ""
    if dtype == BFLOAT16:
        return "_bf16acc"
    raise ValueError(f"acc must be float32 or bfloat16, got {dtype.name}")


def _check_rope_inputs(q, k, positions, cos_sin) -> tuple[int, int]:
    """rope's and rope_write_kv's checks of q [T, H, D], k [T, Hkv, D] (q's dtype, row-strided views
    allowed), positions [T] int32 and cos_sin [P, D]; returns the row strides (q_stride, k_stride)."""
    q_stride = _check_rows("q", q, 3, q.dtype)
    k_stride = _check_rows("k", k, 3, q.dtype)
    _check_array("positions", positions, np.int32, 1)
    _require(isinstance(cos_sin, cupy.ndarray) and cos_sin.dtype in (q.dtype, np.float32) and cos_sin.ndim == 2
             and cos_sin.flags.c_contiguous,
             f"cos_sin_cache must be a contiguous 2-D {q.dtype.name}/float32 cupy array, got "
             f"{getattr(cos_sin, 'dtype', type(cos_sin))}")
    num_tokens, _, head_dim = q.shape
    _require(k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k shape {k.shape} does not fit q shape {q.shape}")
    _require(positions.shape[0] == num_tokens, f"{positions.shape[0]} positions for {num_tokens} tokens")
    _require(cos_sin.shape[1] == head_dim, f"cos_sin_cache is {cos_sin.shape[1]} wide, head dim is {head_dim}")
    _require(head_dim % 2 == 0, f"head dim {head_dim} must be even")
    return q_stride, k_stride


def rope(q, k, positions, cos_sin):
    """Rotate-half RoPE; returns new contiguous (q [T, H, D], k [T, Hkv, D]) of q's dtype (float16 or
    bfloat16; k the same). cos_sin [P, D] of q's dtype or float32."""
    suffix = _element_suffix("q", q)
    q_stride, k_stride = _check_rope_inputs(q, k, positions, cos_sin)
    num_tokens, num_heads, head_dim = q.shape
    q_out = cupy.empty(q.shape, dtype=q.dtype)
    k_out = cupy.empty(k.shape, dtype=q.dtype)
    if num_tokens:
        name = f"rope_f32_cache_{suffix}" if cos_sin.dtype == np.float32 else f"rope_same_cache_{suffix}"
        pairs = (num_heads + k.shape[1]) * (head_dim // 2)  # per token
        vector = _vector_path(head_dim // 2, q, k, cos_sin, q_out, k_out) and q_stride % VECTOR_WIDTH == 0 \
            and k_stride % VECTOR_WIDTH == 0
        _kernel("layer.cu", name)(
            (num_tokens,), (_block_threads(pairs // VECTOR_WIDTH if vector else pairs, 256),),
            (q, k, positions, cos_sin, q_out, k_out, np.int64(q_stride), np.int64(k_stride),
             np.int32(num_heads), np.int32(k.shape[1]), np.int32(head_dim)))
    return q_out, k_out


def rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, kv_scale=None):
    """rope, then write_kv, in one kernel: returns the rotated q as a new contiguous [T, H, D] array and
    writes rotated k[t] and v[t] as they are into k_cache / v_cache row slot_mapping[t] ([N, B, Hkv, D];
    negative slot: token t writes nothing, its q is still rotated). No rotated k is returned (attention
    reads K from the cache). Bit for bit the results of rope + write_kv. q, k, v, caches: float16 or
    bfloat16, all alike (row-strided views of one qkv row are fine); cos_sin [P, D] of q's dtype or float32.
    FP8 KV cache: k_cache / v_cache uint8 and kv_scale [2] float32 on the device; the rotated k and v are
    stored as write_kv's FP8 path stores them (byte for byte rope + write_kv)."""
    suffix = _element_suffix("q", q)
    fp8 = _cache_is_fp8(k_cache, kv_scale)
    q_stride, k_stride = _check_rope_inputs(q, k, positions, cos_sin)
    _check_array("k_cache", k_cache, FP8_STORAGE if fp8 else q.dtype, 4)
    v_stride = _check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    q_out = cupy.empty(q.shape, dtype=q.dtype)
    if num_tokens:
        name = f"rope_write_kv_{'fp8_' if fp8 else ''}{'f32' if cos_sin.dtype == np.float32 else 'same'}_cache_{suffix}"
        num_kv_heads = k.shape[1]
        pairs, v_elems = (num_heads + num_kv_heads) * (head_dim // 2), num_kv_heads * head_dim  # per token
        vector = _vector_path(head_dim // 2, q, k, v, cos_sin, q_out, k_cache, v_cache) \
            and q_stride % VECTOR_WIDTH == 0 and k_stride % VECTOR_WIDTH == 0 and v_stride % VECTOR_WIDTH == 0
        units = (pairs + v_elems) // VECTOR_WIDTH if vector else pairs + v_elems
        _kernel("layer.cu", name)(
            (num_tokens,), (_block_threads(units, 256),),
            (q, k, v, positions, cos_sin, slot_mapping, *((kv_scale,) if fp8 else ()), q_out, k_cache, v_cache,
             np.int64(q_stride),
             np.int64(k_stride), np.int64(v_stride), np.int32(num_heads), np.int32(num_kv_heads),
             np.int32(head_dim)))
    return q_out


def rope_write_kv_product_fits(product, dtype, head_dim: int, cos_sin) -> bool:
    """Whether rope_write_kv_product can take this qkv product (its kernel has only the 16-byte path): head_dim / 2
    a multiple of 8, the product's padded row a multiple of 8 wide, cos_sin of the activations' dtype, every array
    16-byte aligned."""
    acc, x_scale, w_scale, _ = product
    return (head_dim // 2 % VECTOR_WIDTH == 0 and head_dim % 2 == 0 and acc.shape[1] % VECTOR_WIDTH == 0
            and getattr(cos_sin, "dtype", None) == np.dtype(dtype) and _vector_path(head_dim, acc, w_scale, cos_sin))


def rope_write_kv_product(product, dtype, num_heads: int, positions, cos_sin, k_cache, v_cache, slot_mapping,
                          kv_scale=None):
    """rope_write_kv of the q, k, v columns of the qkv projection's FP8 product before its scale epilogue (`product`
    as silu_mul_fp8's: (acc [T, Np], x_scale [T], w_scale [Np], N = (H + 2 Hkv) D), the outputs of `dtype`): byte
    for byte scale_fp8_output, then rope_write_kv of its q, k, v views, in one launch. Returns the rotated q [T, H, D];
    Hkv and D come from the cache ([N, B, Hkv, D]); needs rope_write_kv_product_fits."""
    suffix = ELEMENT_SUFFIX.get(np.dtype(dtype))
    _require(suffix is not None, f"dtype must be float16 or bfloat16, got {dtype}")
    num_tokens, width, x_args, acc_tag = _product_args(product)
    fp8 = _cache_is_fp8(k_cache, kv_scale)
    _check_array("k_cache", k_cache, FP8_STORAGE if fp8 else np.dtype(dtype), 4)
    _check_array("v_cache", v_cache, k_cache.dtype, 4)
    _require(k_cache.shape == v_cache.shape, f"k_cache shape {k_cache.shape} != v_cache shape {v_cache.shape}")
    num_kv_heads, head_dim = k_cache.shape[2:]
    _require(width == (num_heads + 2 * num_kv_heads) * head_dim,
             f"a qkv product {width} wide does not hold {num_heads} + 2 x {num_kv_heads} heads of {head_dim}")
    _check_array("positions", positions, np.int32, 1)
    _check_array("slot_mapping", slot_mapping, np.int32, 1)
    _require(positions.shape[0] == num_tokens and slot_mapping.shape[0] == num_tokens,
             f"{positions.shape[0]} positions and {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    _require(isinstance(cos_sin, cupy.ndarray) and cos_sin.ndim == 2 and cos_sin.flags.c_contiguous
             and cos_sin.shape[1] == head_dim, f"cos_sin_cache must be a contiguous [P, {head_dim}] cupy array")
    _require(rope_write_kv_product_fits(product, dtype, head_dim, cos_sin),
             "rope_write_kv_product needs head_dim / 2 a multiple of 8, 16-byte aligned rows and cos_sin of the "
             "outputs' dtype")
    q_out = cupy.empty((num_tokens, num_heads, head_dim), dtype=dtype)
    if num_tokens:
        units = ((num_heads + num_kv_heads) * (head_dim // 2) + num_kv_heads * head_dim) // VECTOR_WIDTH
        _kernel("layer.cu", f"rope_write_kv_{'fp8_' if fp8 else ''}product{acc_tag}_{suffix}")(
            (num_tokens,), (_block_threads(units, 256),),
            (*x_args, positions, cos_sin, slot_mapping, *((kv_scale,) if fp8 else ()), q_out, k_cache, v_cache,
             np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim)))
    return q_out


def silu_mul(gate_up):
    """silu(gate_up[:, :I]) * gate_up[:, I:]; [T, 2I] -> [T, I] (float16 or bfloat16)."""
    suffix = _element_suffix("gate_up", gate_up)
    _check_array("gate_up", gate_up, gate_up.dtype, 2)
    _require(gate_up.shape[1] % 2 == 0, f"gate_up width {gate_up.shape[1]} is odd")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = cupy.empty((num_tokens, inter), dtype=gate_up.dtype)
    if num_tokens * inter:
        columns = inter // VECTOR_WIDTH if _vector_path(inter, gate_up, out) else inter
        threads = _block_threads(columns, 256)
        grid = (math.ceil(columns / threads), min(num_tokens, MAX_GRID_Y))
        _kernel("layer.cu", f"silu_mul_{suffix}")(grid, (threads,), (gate_up, out, np.int64(num_tokens), np.int32(inter)))
    return out


def silu_mul_fp8(gate_up, padded_width: int | None = None, static_scale: float | None = None, product=None,
                 dtype=None):
    """silu_mul whose output goes straight into an FP8 linear: (xq [T, Kp] uint8 e4m3 bits, scales [T] float32),
    byte for byte silu_mul then fp8_launcher.quantize_rows_fp8(out, padded_width, static_scale). Kp =
    padded_width (default: I rounded up to 16); columns I..Kp-1 of xq are 0. One block per token row.
    product = (acc [T, Np] float32 / bfloat16, acc_x_scale [T], acc_w_scale [Np], 2I) with gate_up None and `dtype`
    (float16 / bfloat16): gate_up is an FP8 GEMM's product before its epilogue, read in (rms_norm_fp8's `product`)."""
    if product is None:
        suffix = _element_suffix("gate_up", gate_up)
        _check_array("gate_up", gate_up, gate_up.dtype, 2)
        num_tokens, width = gate_up.shape
        name, x_args = f"silu_mul_fp8_{suffix}", (gate_up,)
    else:
        suffix = ELEMENT_SUFFIX.get(np.dtype(dtype))
        _require(suffix is not None, f"dtype must be float16 or bfloat16, got {dtype}")
        num_tokens, width, x_args, acc_tag = _product_args(product)
        name = f"silu_mul_fp8_product{acc_tag}_{suffix}"
    _require(width % 2 == 0, f"gate_up width {width} is odd")
    inter = width // 2
    xq, scales = fp8_rows(num_tokens, inter, padded_width, static_scale)
    padded_width = xq.shape[1]
    if num_tokens:
        units = inter // VECTOR_WIDTH if (inter % VECTOR_WIDTH == 0 and xq.data.ptr % 16 == 0) else inter
        _kernel("layer.cu", name)(
            (num_tokens,), (fp8_input_threads(units, num_tokens, _num_sms()),),
            (*x_args, xq, scales, np.int32(inter), np.int32(padded_width), np.float32(static_scale or 0.0)))
    return xq, scales


def add_bias(x, bias):
    """x += bias in place, each sum rounded once; x [T, N] contiguous, bias [N] (float16 or bfloat16)."""
    suffix = _element_suffix("x", x)
    _check_array("x", x, x.dtype, 2)
    _check_array("bias", bias, x.dtype, 1)
    _require(bias.shape[0] == x.shape[1], f"bias length {bias.shape[0]} != x width {x.shape[1]}")
    total = x.size
    if total:
        blocks = min(math.ceil(total / 256), 8 * _num_sms() * 8)
        _kernel("layer.cu", f"add_bias_{suffix}")((blocks,), (256,), (x, bias, np.int64(total), np.int32(x.shape[1])))
    return x
