"""cuBLASLt's FP8 fast accumulation (GPU): how much faster each FP8 GEMM of a preset runs with it, and how far its
sums move from exact ones.

Without the flag, cuBLASLt moves the tensor cores' reduced-precision running sums into float32 registers every
few k-steps; with it (cublaslt.FP8_FAST_ACCUM) they stay in the tensor cores for the whole inner dimension. For each
linear and row count: the median CUDA-graph replay of the tuned product (bfloat16 sums, as the engine writes them)
without and with the flag, and the error of each one's float32 sums against a float32 product of the same e4m3
values, relative to sum_k |x_k w_k| of the entry (the scale of the terms summed, so cancellation does not inflate
it): its maximum and its 99th percentile over the output. Inputs: Gaussian rows and weight columns quantized as
the engine quantizes them (per row and per output channel to e4m3's range).

--heuristic: cuBLASLt's first candidate instead of the tuned pick (what the engine's eager steps run: their
TunedGemm does not time shapes), times only.

    PYTHONPATH=benchmarks python3 benchmarks/fp8_fast_accum.py [--rows 256 8192] [--preset llama-3.1-8b] [--heuristic]
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np
from bench_fp8_epilogue import linears
from bench_kernels import graph_ms

from offline_paged.ops.cublaslt import TunedGemm
from offline_paged.ops.fp8_launcher import quantize_rows_fp8
from offline_paged.ops.fp8_linear import BFLOAT16
from offline_paged.ops.kv_scales import FP8_E4M3


def e4m3_rows(rows: int, width: int):
    """[rows, width] e4m3 bytes (uint8, on the device): Gaussian rows, each scaled to e4m3's range by the engine's
    per-token quantize kernel."""
    return quantize_rows_fp8(cupy.random.standard_normal((rows, width), dtype=np.float32).astype(np.float16))[0]


def relative_errors(acc, exact, terms) -> tuple[float, float]:
    """(max, 99th percentile) of |acc - exact| / terms over the entries (terms: sum |x_k w_k| of each)."""
    error = cupy.abs(acc - exact) / cupy.maximum(terms, cupy.float32(1e-30))
    return float(error.max()), float(cupy.percentile(error.ravel()[:4_000_000], 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[256, 8192])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--heuristic", action="store_true", help="the heuristic's first candidate; times only")
    args = parser.parse_args()
    decode = cupy.asarray(np.arange(256, dtype=np.uint8).view(FP8_E4M3).astype(np.float32))  # byte -> value
    print(f"{args.preset}: FP8 GEMMs ({'heuristic' if args.heuristic else 'tuned'} pick), bfloat16 sums timed; "
          f"errors of float32 sums / sum|terms|")
    print(f"{'linear':>8}{'rows':>6}{'off us':>9}{'fast us':>9}{'speed-up':>10}{'off max':>10}{'off p99':>10}"
          f"{'fast max':>10}{'fast p99':>10}")
    cupy.random.seed(0)
    for name, k, n in linears(args.preset):
        wq = cupy.asarray(e4m3_rows(n, k))  # [N, K], per output channel
        w = decode[wq]
        for rows in args.rows:
            xq = cupy.asarray(e4m3_rows(rows, k))  # [R, K]
            if not args.heuristic:
                x = decode[xq]
                exact, terms = x @ w.T, cupy.abs(x) @ cupy.abs(w).T  # [R, N] float32
            line = f"{name:>8}{rows:>6}"
            times, errors = [], []
            for fast in (False, True):
                stream = cupy.cuda.Stream(non_blocking=True)
                gemm = TunedGemm(stream, tune=not args.heuristic, fp8_fast_accum=fast)
                acc16 = cupy.empty((rows, n), dtype=BFLOAT16)
                acc32 = cupy.empty((rows, n), dtype=np.float32)
                with stream:
                    gemm.fp8(xq, wq, acc16)  # tuned here, outside the capture
                    gemm.fp8(xq, wq, acc32)
                stream.synchronize()
                times.append(graph_ms(lambda: gemm.fp8(xq, wq, acc16), repeats=20, stream=stream) * 1e3)
                if not args.heuristic:
                    errors.extend(relative_errors(acc32, exact, terms))
            line += f"{times[0]:>9.1f}{times[1]:>9.1f}{times[0] / times[1]:>9.3f}x"
            print(line + "".join(f"{e:>10.2e}" for e in errors), flush=True)
            if not args.heuristic:
                del x, exact, terms
        del w


if __name__ == "__main__":
    main()
