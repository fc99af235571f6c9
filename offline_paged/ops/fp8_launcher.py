"""Thin typed launchers for cuda/fp8_linear.cu, one per kernel: each checks dtypes, contiguity and shapes, raises
ValueError saying what is wrong, then launches on the current CuPy stream without synchronising.

Legend: R rows (tokens, or a weight's output channels), K inner width, Kp K padded to a multiple of 16 (cuBLASLt's
FP8 rule), N output width, Np N padded likewise. FP8 arrays are uint8 (the e4m3fn bits; CuPy has no float8).
"""
from __future__ import annotations

import cupy
import numpy as np

from offline_paged.ops.kernel_modules import kernel
from offline_paged.ops.kv_scales import FP8_STORAGE_CUDA as FP8_STORAGE
from offline_paged.ops.launchers import _vector_path, accumulator_tag, fp8_padded, fp8_rows

try:
    import ml_dtypes

    _SUFFIX = {np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16"}
except ImportError:  # a bfloat16 array cannot exist without ml_dtypes anyway
    _SUFFIX = {np.dtype(np.float16): "f16"}

SOURCE = "fp8_linear.cu"
# Every (source, entry point) launched here (tests/test_cuda_compile.py checks them; _kernel refuses others).
KERNELS = (
    ("fp8_linear.cu", "quantize_rows_fp8_f16"), ("fp8_linear.cu", "quantize_rows_fp8_bf16"),
    ("fp8_linear.cu", "scale_fp8_output_f16"), ("fp8_linear.cu", "scale_fp8_output_bf16"),
    ("fp8_linear.cu", "quantize_rows_fp8_vec_f16"), ("fp8_linear.cu", "quantize_rows_fp8_vec_bf16"),
    ("fp8_linear.cu", "scale_fp8_output_vec_f16"), ("fp8_linear.cu", "scale_fp8_output_vec_bf16"),
    # ... reading a bfloat16 accumulator (fp8_linear.BF16_PRODUCTS):
    ("fp8_linear.cu", "scale_fp8_output_bf16acc_f16"), ("fp8_linear.cu", "scale_fp8_output_bf16acc_bf16"),
    ("fp8_linear.cu", "scale_fp8_output_vec_bf16acc_f16"), ("fp8_linear.cu", "scale_fp8_output_vec_bf16acc_bf16"),
)
# The 16-byte forms of both kernels (the same bytes and values; 8 elements a thread per load) where the shapes and
# alignments allow. On since session 30's device run (tests/test_ops_cuda_fp8_linear.py passed with both forms; at
# the 8B shape, bf16, FP8 weights + KV: 12,749 against 12,052 out tok/s, benchmarks/RESULTS.md 2026-12-03 (30)).
VECTOR_KERNELS = True
QUANT_THREADS = 256  # fp8_linear.cu's QUANT_THREADS
MAX_ROW_BLOCKS = 65535  # both kernels stride over rows past this many blocks (CUDA's gridDim.y limit)
_COLUMN_BLOCKS = 64  # scale_fp8_output: blocks of 256 columns per row at most (they stride past it)




def _kernel(filename: str, name: str):
    if (filename, name) not in KERNELS:
        raise RuntimeError(f"{filename}:{name} is not declared in fp8_launcher.KERNELS")
    return kernel(filename, name)


def _suffix(name: str, a) -> str:
    if not isinstance(a, cupy.ndarray):
        raise ValueError(f"{name} must be a cupy.ndarray, got {type(a).__name__}")
    suffix = _SUFFIX.get(np.dtype(a.dtype))
    if suffix is None:
        raise ValueError(f"{name} must be float16 or bfloat16, got {a.dtype.name}")
    return suffix


def _check(name: str, a, dtype, shape: tuple) -> None:
    """`a` is a C-contiguous cupy array of `dtype` and `shape` (messages formatted only on failure)."""
    if not isinstance(a, cupy.ndarray):
        raise ValueError(f"{name} must be a cupy.ndarray, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype.name}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {a.shape}, strides {a.strides})")


def quantize_rows_fp8(x, padded_width: int | None = None, static_scale: float | None = None, xq=None, scales=None):
    """x [R, K] float16 / bfloat16 -> (xq [R, Kp] uint8 e4m3 bits, scales [R] float32): per row r, scales[r] =
    max|x[r]| / 448 (1.0 for a zero row), or `static_scale` for every row; xq[r, :K] = e4m3(x[r] / scales[r])
    (nearest even, saturating), xq[r, K:] = 0. Kp = padded_width (default: K rounded up to 16). Byte for byte
    fp8_linear.quantize_rows (quantize_static) of x as float32. `xq`, `scales`: arrays to write into."""
    suffix = _suffix("x", x)
    if x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError(f"x must be a C-contiguous 2-D array, got shape {x.shape}, strides {x.strides}")
    num_rows, width = x.shape
    padded_width = fp8_padded(width) if padded_width is None else int(padded_width)
    xq, scales = fp8_rows(num_rows, width, padded_width, static_scale, xq, scales)  # [R, Kp], [R]
    _check("xq", xq, FP8_STORAGE, (num_rows, padded_width))
    _check("scales", scales, np.float32, (num_rows,))
    if num_rows:
        vector = VECTOR_KERNELS and _vector_path(width, x, xq)  # rows of 8-element pieces, 16-byte aligned
        if vector:
            quantize = (_kernel(SOURCE, "quantize_rows_fp8_vec_f16") if suffix == "f16"
                        else _kernel(SOURCE, "quantize_rows_fp8_vec_bf16"))
        else:
            quantize = (_kernel(SOURCE, "quantize_rows_fp8_f16") if suffix == "f16"
                        else _kernel(SOURCE, "quantize_rows_fp8_bf16"))
        quantize(
            (min(num_rows, MAX_ROW_BLOCKS),), (QUANT_THREADS,),
            (x, xq, scales, np.int64(num_rows), np.int32(width), np.int32(padded_width),
             np.float32(static_scale or 0.0)))
    return xq, scales


def scale_fp8_output(acc, x_scale, w_scale, num_out: int, dtype, out=None):
    """acc [R, Np] float32 or bfloat16 (the FP8 GEMM's sums, rounded or not), x_scale [R], w_scale [Np] float32 ->
    out [R, N] of `dtype` (float16 / bfloat16): (acc[r, j] * x_scale[r]) * w_scale[j] in float32, rounded once,
    N = num_out <= Np."""
    if not isinstance(acc, cupy.ndarray) or acc.ndim != 2:
        raise ValueError(f"acc must be a 2-D cupy.ndarray, got {getattr(acc, 'shape', type(acc).__name__)}")
    num_rows, padded_out = acc.shape
    if not 0 <= num_out <= padded_out:
        raise ValueError(f"num_out must be in [0, {padded_out}], got {num_out}")
    acc_tag = accumulator_tag(acc)
    _check("acc", acc, acc.dtype, (num_rows, padded_out))
    _check("x_scale", x_scale, np.float32, (num_rows,))
    _check("w_scale", w_scale, np.float32, (padded_out,))
    out = cupy.empty((num_rows, num_out), dtype=dtype) if out is None else out  # [R, N]
    suffix = _suffix("out", out)
    _check("out", out, out.dtype, (num_rows, num_out))
    if num_rows * num_out:
        vector = (VECTOR_KERNELS and num_out % 4 == 0 and padded_out % 4 == 0 and acc.data.ptr % 16 == 0
                  and w_scale.data.ptr % 16 == 0 and out.data.ptr % 8 == 0)
        columns = num_out // 4 if vector else num_out  # a thread's unit: 4 columns, or one
        grid = (min(-(-columns // 256), _COLUMN_BLOCKS), min(num_rows, MAX_ROW_BLOCKS))
        scale = _kernel(SOURCE, f"scale_fp8_output{'_vec' if vector else ''}{acc_tag}_{suffix}")
        scale(
            grid, (256,), (acc, x_scale, w_scale, out, np.int64(num_rows), np.int32(num_out),
                                np.int32(padded_out)))
    return out
