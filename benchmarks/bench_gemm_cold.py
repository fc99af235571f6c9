"""The decode step's GEMMs with their weights cold (GPU): what a real step sees, where each layer's weights come
from HBM once, against what TunedGemm's tuning sees, the same weights replayed hot in the 50 MB L2.

For each shape and row count, every time is a CUDA-graph replay of the product over `copies` distinct weight
arrays in turn (together at least --cold-mb, so none is in L2 when its turn comes), per product:
- `hot us`: TunedGemm's choice (tuned as the engine tunes it: the same weights replayed, hot), replayed hot;
- `tuned`: that choice, cold;
- `best cand`: the fastest of the same cuBLASLt candidates timed cold here, and its index in the list (the hot
  tuning's index after the slash);
- `split s`: split-K by hand, one cublasGemmStridedBatchedEx of s batches (K / s each) into float32 partials,
  then (the `+red` figure) a kernel summing them into the 16-bit output;
- the floors: the weight bytes at the copy bandwidth, and the FLOPs at --peak-tflops.

    PYTHONPATH=benchmarks python3 benchmarks/bench_gemm_cold.py [--rows 64 128 256] [--presets llama-3.2-1b]
"""
from __future__ import annotations

import argparse
import ctypes
import math

import cupy
import numpy as np
from bench_gemm import projections
from bench_kernels import copy_bandwidth_gbs, graph_ms

from offline_paged.ops.cublaslt import TunedGemm
from offline_paged.ops.graphs import (_CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT, _CUDA_R_16F, _CUDA_R_32F, _OP_N,
                                      CublasGemm, check_status)

_REDUCE = cupy.RawKernel(r"""
#include <cuda_fp16.h>
extern "C" __global__ void reduce_parts(const float* parts, __half* out, int n, int splits) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int j = 0; j < splits; ++j) s += parts[(size_t)j * n + i];
    out[i] = __float2half_rn(s);
  }
}
""", "reduce_parts")


def replay_us(stream, fn, calls: int, repeats: int) -> float:
    """Median µs per call of fn (which makes `calls` products) replayed from a CUDA graph on `stream`."""
    return graph_ms(fn, repeats, stream) * 1e3 / calls


def split_k(cublas: CublasGemm, x, w, parts, splits: int) -> None:
    """parts [s, T, N] float32 = the s partial products x[:, Ks i : Ks (i+1)] @ w[Ks i : Ks (i+1)] (column-major
    as CublasGemm: out^T = W^T x^T, batch i offset by Ks rows of w and Ks columns of x)."""
    rows, inner = x.shape
    num_out = w.shape[1]
    ks = inner // splits
    fn = cublas._lib.cublasGemmStridedBatchedEx
    i, p, ll = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
    fn.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i]
    fn.restype = ctypes.c_int
    check_status(fn(cublas._handle, _OP_N, _OP_N, num_out, rows, ks,
                    cublas._one.ctypes.data, w.data.ptr, _CUDA_R_16F, num_out, ks * num_out,
                    x.data.ptr, _CUDA_R_16F, inner, ks,
                    cublas._zero.ctypes.data, parts.data.ptr, _CUDA_R_32F, num_out, rows * num_out,
                    splits, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT), "cublasGemmStridedBatchedEx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--presets", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    parser.add_argument("--splits", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--cold-mb", type=float, default=256.0)
    parser.add_argument("--peak-tflops", type=float, default=720.0)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    copy = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy:,.0f} GB/s")
    head = f"{'preset':<14}{'proj':<9}{'rows':>5}{'copies':>7}{'hot us':>8}{'tuned':>8}{'best cand':>13}"
    head += "".join(f"{f'split {s}':>9}{'+red':>7}" for s in args.splits) + f"{'bytes us':>9}{'flops us':>9}"
    print(head)
    rng = np.random.default_rng(0)
    for preset in args.presets:
        for name, inner, num_out in projections(preset):
            if name == "lm_head":
                continue
            w_bytes = inner * num_out * 2
            copies = max(2, math.ceil(args.cold_mb * 1e6 / w_bytes))
            ws = [cupy.asarray((rng.standard_normal((inner, num_out), dtype=np.float32) * 0.02).astype(np.float16))
                  for _ in range(copies)]
            for rows in args.rows:
                x = cupy.asarray(rng.standard_normal((rows, inner), dtype=np.float32).astype(np.float16))
                out = cupy.empty((rows, num_out), dtype=np.float16)
                stream = cupy.cuda.Stream(non_blocking=True)
                tuned = TunedGemm(stream)
                with stream:
                    tuned(x, ws[0], out=out)  # tuned as the engine tunes it: the same weights replayed, hot
                stream.synchronize()
                plan = next(iter(tuned.plans.values()))
                hot = replay_us(stream, lambda: [tuned(x, ws[0], out=out) for _ in range(copies)], copies, args.repeats)
                cold = replay_us(stream, lambda: [tuned(x, w, out=out) for w in ws], copies, args.repeats)
                per_algo = [replay_us(stream, lambda a=algo: [tuned._run(plan, a, x, w, out, stream) for w in ws],
                                      copies, args.repeats) for algo in plan.algos]
                best = int(np.argmin(per_algo))
                line = (f"{preset:<14}{name:<9}{rows:>5}{copies:>7}{hot:>8.1f}{cold:>8.1f}"
                        f"{f'{per_algo[best]:.1f} ({best}/{plan.chosen})':>13}")
                cublas = CublasGemm(stream)
                for s in args.splits:
                    if inner % s:
                        line += f"{'-':>9}{'-':>7}"
                        continue
                    parts = cupy.empty((s, rows, num_out), dtype=np.float32)
                    gemm = replay_us(stream, lambda: [split_k(cublas, x, w, parts, s) for w in ws], copies,
                                     args.repeats)
                    n = rows * num_out

                    def both(s=s, parts=parts, n=n):
                        for w in ws:
                            split_k(cublas, x, w, parts, s)
                            _REDUCE((min(1024, (n + 255) // 256),), (256,), (parts, out, np.int32(n), np.int32(s)))
                    line += f"{gemm:>9.1f}{replay_us(stream, both, copies, args.repeats):>7.1f}"
                bytes_us = w_bytes / (copy * 1e9) * 1e6
                flops_us = 2 * rows * inner * num_out / (args.peak_tflops * 1e12) * 1e6
                print(line + f"{bytes_us:>9.1f}{flops_us:>9.1f}", flush=True)
            del ws


if __name__ == "__main__":
    main()
