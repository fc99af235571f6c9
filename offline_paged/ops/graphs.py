"""CublasGemm: an fp16 or bf16 x @ W (fp32 accumulation) that can be captured into a CUDA graph.

CuPy's matmul refuses stream capture, and CuPy's low-level `cublas.gemmEx` resets the handle's stream
before every call (which also drops a user workspace). So this calls libcuBLAS through ctypes on a
handle of its own: the stream is set once (the capture stream), then an explicitly owned workspace, so
cuBLAS never allocates while a graph is being captured.

Row-major x [T, K] @ W [K, N] -> out [T, N] is the column-major product out^T [N, T] = W^T [N, K] x^T [K, T]:
row-major x is column-major x^T with ld K, row-major out is column-major out^T with ld N. A C-contiguous
W [K, N] is column-major W^T (op N, lda N); an F-contiguous W (a transposed view, e.g. a tied lm_head
= embed.T) is column-major [K, N] with ld K, so op T with lda K.
Legend: T rows (tokens), K inner dim, N output dim.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc

import cupy
import numpy as np

_OP_N, _OP_T = 0, 1
_CUDA_R_16F = 2
_CUDA_R_16BF = 14
_CUDA_R_32F = 0
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # what PyTorch gives cuBLAS on Hopper


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection inside a stream capture. A collection there may finalize another
    object's CUDA resources (a memory pool's cudaFree, a stream or event destroyed), calls that are not
    allowed while a stream captures: they invalidate the capture (cudaErrorStreamCaptureInvalidated).
    Seen on the device when an earlier engine's DecodeGraphs became garbage in a reference cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def uploaded(graph):
    """`graph` (a captured cupy Graph) uploaded to the device on the current stream, where the engine replays it.
    A graph's first launch uploads it otherwise, in the step loop: a decode graph's first launch held the host
    215 us (median) against 18 us once uploaded at capture (H100, session 39)."""
    graph.upload()
    return graph


def libcublas_paths() -> list[str]:
    """The paths of the libcublas CuPy loaded (found in this process's mappings), sorted."""
    cupy.cuda.device.get_cublas_handle()  # makes CuPy load it
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/libcublas.so" in line})


def _libcublas() -> ctypes.CDLL:
    """The libcublas CuPy already loaded, so both share one copy."""
    paths = libcublas_paths()
    if not paths:
        raise RuntimeError("libcublas is not loaded in this process; cannot build a capture-safe GEMM")
    lib = ctypes.CDLL(paths[0])
    handle_p = ctypes.c_void_p
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(handle_p)]
    lib.cublasDestroy_v2.argtypes = [handle_p]
    lib.cublasSetStream_v2.argtypes = [handle_p, ctypes.c_void_p]
    lib.cublasSetWorkspace_v2.argtypes = [handle_p, ctypes.c_void_p, ctypes.c_size_t]
    i, p = ctypes.c_int, ctypes.c_void_p
    lib.cublasGemmEx.argtypes = [handle_p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    for name in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _cuda_type(dtype) -> int | None:
    """cudaDataType of a float16 / bfloat16 / float32 numpy dtype, None for anything else."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return _CUDA_R_16F
    if dtype == np.float32:
        return _CUDA_R_32F
    return _CUDA_R_16BF if dtype.name == "bfloat16" else None  # ml_dtypes.bfloat16


def check_status(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def check_gemm_args(x, w, out_dtype, out):
    """Validate a GEMM call x [T, K] @ w [K, N] -> [T, N] (see CublasGemm.__call__) and return
    ((T, K, N, op_w, input cudaDataType, output cudaDataType), out), allocating `out` when it is None."""
    for name, a in (("x", x), ("w", w)):
        if not isinstance(a, cupy.ndarray) or a.ndim != 2 or _cuda_type(a.dtype) in (None, _CUDA_R_32F):
            raise ValueError(f"{name} must be a 2-D float16 or bfloat16 cupy.ndarray, got "
                             f"{getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')}")
    if w.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype.name} but w is {w.dtype.name}")
    in_type = _cuda_type(x.dtype)
    if not x.flags.c_contiguous:
        raise ValueError(f"x must be C-contiguous (shape {x.shape}, strides {x.strides})")
    (num_rows, inner), (w_inner, num_out) = x.shape, w.shape
    if inner != w_inner:
        raise ValueError(f"x is [{num_rows}, {inner}] but w is [{w_inner}, {num_out}]")
    if w.flags.c_contiguous:
        op_w = _OP_N
    elif w.flags.f_contiguous:
        op_w = _OP_T
    else:
        raise ValueError(f"w must be C- or F-contiguous (shape {w.shape}, strides {w.strides})")
    out_dtype = x.dtype if out_dtype is None else np.dtype(out_dtype)
    if out_dtype not in (x.dtype, np.dtype(np.float32)):
        raise ValueError(f"out_dtype must be {x.dtype.name} (the input dtype) or float32, got {out_dtype}")
    out_type = _cuda_type(out_dtype)
    if out is None:
        out = cupy.empty((num_rows, num_out), dtype=out_dtype)  # [T, N]
    elif (not isinstance(out, cupy.ndarray) or out.shape != (num_rows, num_out) or out.dtype != out_dtype
          or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous {out_dtype.name} cupy.ndarray of shape "
                         f"{(num_rows, num_out)}, got {getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
    return (num_rows, inner, num_out, op_w, in_type, out_type), out


class CublasGemm:
    """fp16 / bf16 GEMMs with fp32 accumulation (CUBLAS_COMPUTE_32F) on `stream` only (a handle and workspace of its own).

    Call it inside `with stream:` so the output allocation is ordered on the same stream."""

    def __init__(self, stream: cupy.cuda.Stream, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self._lib = _libcublas()
        self._handle = ctypes.c_void_p()
        check_status(self._lib.cublasCreate_v2(ctypes.byref(self._handle)), "cublasCreate")
        self.stream = stream
        # SetStream resets the workspace to cuBLAS's default, so the workspace is set after it.
        check_status(self._lib.cublasSetStream_v2(self._handle, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
        self._workspace = cupy.empty(workspace_bytes, dtype=cupy.uint8)  # [bytes]
        check_status(self._lib.cublasSetWorkspace_v2(self._handle, ctypes.c_void_p(self._workspace.data.ptr),
                                               workspace_bytes), "cublasSetWorkspace")
        self._one = np.ones(1, dtype=np.float32)  # host scalars: cuBLAS reads them when the call is made
        self._zero = np.zeros(1, dtype=np.float32)

    def __call__(self, x, w, out_dtype=None, out=None):
        """x [T, K] (C-contiguous) @ w [K, N] (C- or F-contiguous), both float16 or both bfloat16;
        returns a [T, N] of `out_dtype`: None = x's dtype, or float32 (the fp32 accumulator written as
        is: the LM head's logits). `out`: a C-contiguous [T, N] array of that dtype to write into
        (returned); None: a new array."""
        (num_rows, inner, num_out, op_w, in_type, out_type), out = check_gemm_args(x, w, out_dtype, out)
        if out.size == 0:
            return out
        ld_w = num_out if op_w == _OP_N else inner
        check_status(self._lib.cublasGemmEx(
            self._handle, op_w, _OP_N, num_out, num_rows, inner,
            self._one.ctypes.data, w.data.ptr, in_type, ld_w,
            x.data.ptr, in_type, inner,
            self._zero.ctypes.data, out.data.ptr, out_type, num_out,
            _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT), "cublasGemmEx")
        return out

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._lib.cublasDestroy_v2(handle)
