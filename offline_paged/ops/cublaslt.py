"""TunedGemm: CublasGemm's product through cuBLASLt, with the algorithm for each shape picked by timing.

cuBLAS's default heuristic picks one kernel per shape. At a decode step's few hundred rows the product is
small (a 256 x 2048 output is 32 tiles of 128 x 128 on a 132-SM GPU), and the heuristic's first pick is
not always the fastest candidate it lists. So the first call of each shape, made outside any stream
capture, asks cuBLASLt for its candidates (split-K ones included), times each on the stream, and keeps
the fastest; every later call of that shape, captured or not, runs that algorithm. A shape first seen
inside a capture takes the heuristic's first candidate (timing there is impossible).

Layout: row-major x [T, K] @ W [K, N] -> out [T, N] is column-major out^T [N, T] = W^T [N, K] x^T [K, T],
as in graphs.py: A = W (op N with ld N when C-contiguous, op T with ld K when F-contiguous), B = x
(column-major [K, T], ld K), C = D = out (column-major [N, T], ld N).
FP8 (`fp8`): xq [T, Kp] e4m3 @ wq [Np, Kp] e4m3 (a weight kept [out, in]) -> acc [T, Np] float32 or bfloat16, the
same machinery with key (T, Kp, Np, op T, CUDA_R_8F_E4M3, CUDA_R_32F or CUDA_R_16BF): A = wq as column-major
[Kp, Np] ld Kp with op T, B = xq column-major [Kp, T] ld Kp with op N: both operands K-major, the "TN" form
Hopper's FP8 GEMM requires; Kp, Np multiples of 16 (its rule for the inner and leading dimensions). No A/B scales
(1.0): the per-token and per-channel scales are applied by our epilogue (ops/cuda_fp8_linear.py).
Fast accumulation (`FP8_FAST_ACCUM`, cuBLASLt's FAST_ACCUM flag): Hopper's FP8 tensor cores keep their running
sums at reduced precision, and by default cuBLASLt moves them into float32 registers every few k-steps, which costs
instructions beside the tensor cores; with the flag the sums stay in the tensor cores' accumulator for the whole
inner dimension (vLLM's CUTLASS FP8 kernels for sm_90 run so), faster and less exact.
`fp8_scaled` tries cuBLASLt's own epilogue instead: the outer-vector scale modes (A: one float32 per output channel,
B: one per token) and a 16-bit D, so no float32 accumulator goes through memory. Where cuBLASLt has no algorithm
for that (older libraries, architectures without it) it returns False once per shape and the caller falls back.
Legend: T rows, K inner dim, N output dim.
"""
from __future__ import annotations

import ctypes
import glob
import os
import statistics

import cupy
import numpy as np

from offline_paged.ops.cuda_fp8_linear import CudaFp8Linear
from offline_paged.ops.graphs import (_CUDA_R_16BF, _CUDA_R_16F, _OP_N, _OP_T, WORKSPACE_BYTES, _cuda_type,
                                      check_gemm_args, check_status, gc_paused, libcublas_paths)
from offline_paged.ops.launchers import FP8_ALIGN, accumulator_tag  # FP8_ALIGN: cuBLASLt's FP8 GEMM's width rule

_CUDA_R_32F = 0
_CUDA_R_8F_E4M3 = 28
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18  # cublasLtMatmulDescAttributes_t
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_DESC_FAST_ACCUM = 25  # int8_t
_SCALE_OUTER_VEC_32F = 3  # cublasLtMatmulMatrixScale_t: one float32 per row of op(A) / per column of op(B)
_CUBLAS_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
NUM_CANDIDATES = 16  # heuristic candidates asked for per shape
# FP8 products accumulate in the tensor cores for the whole inner dimension (see the module docstring): the
# default of every TunedGemm made after it is set. Measured (H100, session 55): 8B FP8 w + KV 1.023x out tok/s
# (three pairs); each sum within ~2.4e-3 of the sum of its terms' magnitudes (promoted: ~2e-4;
# benchmarks/fp8_fast_accum.py, tests/test_ops_cuda_fp8_linear.py).
FP8_FAST_ACCUM = True


class _Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _liblt() -> ctypes.CDLL:
    """libcublasLt from the folder of the libcublas CuPy loaded (they ship together)."""
    dirs = sorted({os.path.dirname(path) for path in libcublas_paths()})
    candidates = [path for d in dirs for path in sorted(glob.glob(os.path.join(d, "libcublasLt.so*")))]
    if not candidates:
        raise RuntimeError(f"libcublasLt not found next to libcublas (looked in {dirs})")
    lib = ctypes.CDLL(candidates[0])
    p, i, u64, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtDestroy": [p],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
        "cublasLtMatmulDescDestroy": [p],
        "cublasLtMatmulDescSetAttribute": [p, i, p, size],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, u64, u64, i64],
        "cublasLtMatrixLayoutDestroy": [p],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, size],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(_Heuristic), ctypes.POINTER(i)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, size, p],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    return lib


class NoAlgorithm(RuntimeError):
    """cuBLASLt offers no algorithm for a product as described (shape, types, scale modes)."""


class _Plan:
    """The descriptors of one shape and its candidate algorithms; `chosen` indexes the one that runs."""

    def __init__(self, lib, handle, key, workspace_bytes: int, fast_accum: bool = False) -> None:
        num_rows, inner, num_out, op_w, in_type, out_type, *scale_mode = key
        self._lib = lib
        self.desc, self.a, self.b, self.c = (ctypes.c_void_p() for _ in range(4))
        check_status(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
                     "MatmulDescCreate")
        attributes = [(_DESC_TRANSA, op_w), (_DESC_TRANSB, _OP_N)]
        attributes += [(attr, mode) for mode in scale_mode for attr in (_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE)]
        for attr, value in attributes:
            value = ctypes.c_int(value)
            status = lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4)
            if status != 0 and scale_mode:
                raise NoAlgorithm(f"cuBLASLt refuses scale mode {scale_mode[0]} (status {status})")
            check_status(status, "MatmulDescSetAttribute")
        if fast_accum and in_type == _CUDA_R_8F_E4M3:
            flag = ctypes.c_int8(1)
            check_status(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_FAST_ACCUM, ctypes.byref(flag), 1),
                         "MatmulDescSetAttribute (fast accumulation)")
        a_rows, a_cols, a_ld = (num_out, inner, num_out) if op_w == _OP_N else (inner, num_out, inner)
        for layout, args in ((self.a, (in_type, a_rows, a_cols, a_ld)), (self.b, (in_type, inner, num_rows, inner)),
                             (self.c, (out_type, num_out, num_rows, num_out))):
            check_status(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), *args), "MatrixLayoutCreate")
        pref = ctypes.c_void_p()
        check_status(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        limit = ctypes.c_uint64(workspace_bytes)
        check_status(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8),
               "MatmulPreferenceSetAttribute")
        results, count = (_Heuristic * NUM_CANDIDATES)(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.a, self.b, self.c, self.c, pref,
                                                    NUM_CANDIDATES, results, ctypes.byref(count))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0 and scale_mode:
            raise NoAlgorithm(f"cuBLASLt has no algorithm with scale mode {scale_mode[0]} (status {status})")
        check_status(status, f"MatmulAlgoGetHeuristic for [{num_rows}, {inner}] @ [{inner}, {num_out}]")
        self.algos = [results[j].algo for j in range(count.value) if results[j].state == 0]
        if not self.algos:
            raise NoAlgorithm(f"cuBLASLt has no algorithm for [{num_rows}, {inner}] @ [{inner}, {num_out}]")
        self.chosen = 0
        self.times_ms: list[float] = []  # per candidate, when tuned

    def __del__(self) -> None:
        lib = self._lib
        for layout in (self.a, self.b, self.c):
            if layout.value:
                lib.cublasLtMatrixLayoutDestroy(layout)
        if self.desc.value:
            lib.cublasLtMatmulDescDestroy(self.desc)


class TunedGemm:
    """fp16 / bf16 GEMMs with fp32 accumulation through cuBLASLt on `stream` only, with an explicitly owned
    workspace (no allocation inside a capture) and a timed choice of algorithm per shape (see the module
    docstring). The same calls as CublasGemm; call it inside `with stream:`."""

    def __init__(self, stream: cupy.cuda.Stream, workspace_bytes: int = WORKSPACE_BYTES, repeats: int = 5,
                 tune: bool = True, fp8_fast_accum: bool | None = None) -> None:
        self._lib = _liblt()
        self._handle = ctypes.c_void_p()
        check_status(self._lib.cublasLtCreate(ctypes.byref(self._handle)), "cublasLtCreate")
        self.stream = stream
        self.repeats = repeats
        self.tune = tune  # False: always the heuristic's first candidate
        self.fp8_fast_accum = FP8_FAST_ACCUM if fp8_fast_accum is None else fp8_fast_accum
        self._workspace = cupy.empty(workspace_bytes, dtype=cupy.uint8)  # [bytes]
        self._one = np.ones(1, dtype=np.float32)  # host scalars, read when the call is made
        self._zero = np.zeros(1, dtype=np.float32)
        self.plans: dict[tuple, _Plan] = {}
        self.unsupported: set[tuple] = set()  # fp8_scaled keys cuBLASLt has no algorithm for

    def __call__(self, x, w, out_dtype=None, out=None):
        """x [T, K] (C-contiguous) @ w [K, N] (C- or F-contiguous) -> out [T, N] of `out_dtype` (None: x's
        dtype, or float32), written into `out` when given. See CublasGemm.__call__."""
        if isinstance(w, CudaFp8Linear):  # an FP8 layer: its product runs through `fp8` below
            if out_dtype is not None or out is not None:
                raise ValueError("an FP8 linear writes a new array of x's dtype: out_dtype and out must be None")
            return w.apply(x, self)
        key, out = check_gemm_args(x, w, out_dtype, out)
        return self._matmul(key, x, w, out)

    def fp8(self, xq, wq, acc):
        """xq [T, Kp] uint8 (e4m3 bits, C-contiguous) @ wq [Np, Kp] uint8 (C-contiguous, [out, in]) -> acc [T, Np]
        float32 or bfloat16 (written and returned): acc[t, j] = sum_k xq[t, k] wq[j, k], accumulated in fp32 (in
        the tensor cores' own accumulator with fp8_fast_accum) and rounded once to acc's type. See the module
        docstring; the algorithm is picked per shape as for 16-bit products."""
        accumulator_tag(acc)  # float32 or bfloat16, or ValueError
        return self._matmul(check_fp8_args(xq, wq, acc, acc.dtype), xq, wq, acc)

    def fp8_scaled(self, xq, wq, x_scale, w_scale, out) -> bool:
        """out [T, Np] (float16 / bfloat16, written) = (sum_k xq[t, k] wq[j, k]) x_scale[t] w_scale[j], the scales
        applied by cuBLASLt's epilogue (outer-vector modes), rounded once; xq, wq as in `fp8`, x_scale [T] and
        w_scale [Np] float32 on the device. False, with nothing launched, where cuBLASLt has no algorithm for it
        (remembered per shape; a plan first seen inside a capture takes the heuristic's first candidate)."""
        if _cuda_type(getattr(out, "dtype", np.float64)) not in (_CUDA_R_16F, _CUDA_R_16BF):
            raise ValueError(f"fp8_scaled writes float16 or bfloat16, got {getattr(out, 'dtype', type(out))}")
        key = (*check_fp8_args(xq, wq, out, out.dtype), _SCALE_OUTER_VEC_32F)
        for name, v, n in (("x_scale", x_scale, xq.shape[0]), ("w_scale", w_scale, wq.shape[0])):
            if not isinstance(v, cupy.ndarray) or v.dtype != np.float32 or v.shape != (n,) or not v.flags.c_contiguous:
                raise ValueError(f"{name} must be a contiguous float32 cupy.ndarray of shape ({n},), got "
                                 f"{getattr(v, 'dtype', type(v))} {getattr(v, 'shape', '')}")
        if key in self.unsupported:
            return False
        fresh = key not in self.plans
        try:
            self._matmul(key, xq, wq, out, scales=(w_scale, x_scale))
        except NoAlgorithm:
            self.unsupported.add(key)
            return False
        except RuntimeError:
            if not fresh:
                raise
            self.plans.pop(key, None)  # its first run failed: the library cannot do it after all
            self.unsupported.add(key)
            return False
        return True

    def _matmul(self, key: tuple, x, w, out, scales=None):
        """x @ w into out through the plan of `key` (made, and tuned outside a capture, on first use); `scales`:
        device pointers (A's, B's) of an outer-vector plan, set on its descriptor before it runs."""
        if out.size == 0:
            return out
        plan = self.plans.get(key)
        fresh = plan is None
        if fresh:
            plan = _Plan(self._lib, self._handle, key, self._workspace.nbytes, self.fp8_fast_accum)
            self.plans[key] = plan
        if scales is not None:
            for attr, array in zip((_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER), scales):
                pointer = ctypes.c_void_p(array.data.ptr)
                check_status(self._lib.cublasLtMatmulDescSetAttribute(plan.desc, attr, ctypes.byref(pointer), 8),
                             "MatmulDescSetAttribute (scale pointer)")
        if fresh and self.tune and not _capturing(self.stream):
            self._tune(plan, x, w, out)
        self._run(plan, plan.algos[plan.chosen], x, w, out)
        return out

    def _run(self, plan: _Plan, algo: _Algo, x, w, out, stream=None) -> None:
        check_status(self._lib.cublasLtMatmul(
            self._handle, plan.desc, self._one.ctypes.data, w.data.ptr, plan.a, x.data.ptr, plan.b,
            self._zero.ctypes.data, out.data.ptr, plan.c, out.data.ptr, plan.c, ctypes.byref(algo),
            self._workspace.data.ptr, self._workspace.nbytes, (stream or self.stream).ptr), "cublasLtMatmul")

    def _tune(self, plan: _Plan, x, w, out) -> None:
        """Time every candidate and keep the fastest. Each is captured `repeats` times into a graph on a
        private stream and the median of three replays is taken: launched one by one from Python, a call
        of a few microseconds would time the host's launch instead."""
        self.stream.synchronize()  # x and w are ready
        stream = cupy.cuda.Stream(non_blocking=True)
        plan.times_ms = []
        for algo in plan.algos:
            self._run(plan, algo, x, w, out, stream)  # warm-up (loads the kernel)
            with gc_paused():
                stream.begin_capture()
                try:
                    for _ in range(self.repeats):
                        self._run(plan, algo, x, w, out, stream)
                finally:
                    graph = stream.end_capture()
            times = []
            for _ in range(3):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                end.synchronize()
                times.append(cupy.cuda.get_elapsed_time(start, end) / self.repeats)
            plan.times_ms.append(statistics.median(times))
        plan.chosen = int(np.argmin(plan.times_ms))

    def __del__(self) -> None:
        self.plans = {}
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._lib.cublasLtDestroy(handle)


def check_fp8_args(xq, wq, acc, acc_dtype) -> tuple:
    """Validate an FP8 GEMM call (see TunedGemm.fp8: `acc` float32; fp8_scaled: float16 / bfloat16); returns its
    plan key (without a scale mode)."""
    if np.dtype(acc_dtype) != np.float32 and _cuda_type(acc_dtype) not in (_CUDA_R_16F, _CUDA_R_16BF):
        raise ValueError(f"an FP8 GEMM writes float32, float16 or bfloat16, not {np.dtype(acc_dtype).name}")
    for name, a, dtype in (("xq", xq, np.uint8), ("wq", wq, np.uint8), ("acc", acc, acc_dtype)):
        if not isinstance(a, cupy.ndarray) or a.ndim != 2 or a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a 2-D C-contiguous {np.dtype(dtype).name} cupy.ndarray, got "
                             f"{getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')}")
    (num_rows, inner), (num_out, w_inner) = xq.shape, wq.shape
    if inner != w_inner or acc.shape != (num_rows, num_out):
        raise ValueError(f"xq [{num_rows}, {inner}] @ wq[{num_out}, {w_inner}]^T cannot be written to acc {acc.shape}")
    if inner % FP8_ALIGN or num_out % FP8_ALIGN:
        raise ValueError(f"the FP8 GEMM needs the inner and output widths padded to multiples of {FP8_ALIGN}, "
                         f"got {inner} and {num_out}")
    return num_rows, inner, num_out, _OP_T, _CUDA_R_8F_E4M3, _cuda_type(acc_dtype)


def _capturing(stream: cupy.cuda.Stream) -> bool:
    try:
        return cupy.cuda.runtime.streamIsCapturing(stream.ptr) != 0
    except cupy.cuda.runtime.CUDARuntimeError:  # a capture already invalidated is still a capture
        return True
