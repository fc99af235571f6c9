"""Kernel benchmark (GPU): an FP8 linear's input made by one kernel (layer.cu's rms_norm_fp8 / silu_mul_fp8) against
the two launches it replaces (rms_norm or silu_mul, then fp8_launcher.quantize_rows_fp8), at the decode shapes of
Llama-3.2-1B and Llama-3.1-8B in bf16, with the launchers' rule for threads per row (launchers.fp8_input_threads)
and with launchers.FP8_INPUT_CHUNKS_PER_THREAD forced to 1, 2, 4.
Timing as bench_layer_kernels.py (graph replays over input sets larger than L2; median us per call).

    python benchmarks/bench_fp8_inputs.py [--rows 256 64]
"""
from __future__ import annotations

import argparse

import cupy
import ml_dtypes
import numpy as np
from bench_layer_kernels import SHAPES, graph_us, num_sets

from offline_paged.ops import launchers
from offline_paged.ops.fp8_launcher import quantize_rows_fp8

BF16 = np.dtype(ml_dtypes.bfloat16)


def randn(*shape):
    return cupy.asarray(cupy.random.standard_normal(shape, dtype=cupy.float32).get().astype(BF16))


def rms_norm_calls(rows: int, hidden: int, fused: bool):
    weight = randn(hidden)
    sets = [(randn(rows, hidden), randn(rows, hidden)) for _ in range(num_sets(6 * rows * hidden))]
    if fused:
        return [lambda x=x, r=r: launchers.rms_norm_fp8(x, weight, 1e-5, r) for x, r in sets]
    return [lambda x=x, r=r: quantize_rows_fp8(launchers.rms_norm(x, weight, 1e-5, r)[0]) for x, r in sets]


def silu_mul_calls(rows: int, inter: int, fused: bool):
    sets = [randn(rows, 2 * inter) for _ in range(num_sets(5 * rows * inter))]
    if fused:
        return [lambda g=g: launchers.silu_mul_fp8(g) for g in sets]
    return [lambda g=g: quantize_rows_fp8(launchers.silu_mul(g)) for g in sets]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 64])
    args = parser.parse_args()
    chunk_choices = (None, 1, 2, 4)  # None: the rule
    default = launchers.FP8_INPUT_CHUNKS_PER_THREAD
    print(f"{'shape':<14}{'rows':>6}{'kernel':>10}{'two launches us':>17}"
          + "".join(f"{'fused ' + (f'k={k}' if k else 'rule') + ' us':>18}" for k in chunk_choices))
    for name, (hidden, inter, *_) in SHAPES.items():
        for rows in args.rows:
            for kernel, calls, width in (("rms_norm", rms_norm_calls, hidden), ("silu_mul", silu_mul_calls, inter)):
                two = graph_us(calls(rows, width, False))
                fused = []
                for k in chunk_choices:
                    launchers.FP8_INPUT_CHUNKS_PER_THREAD = k
                    fused.append(graph_us(calls(rows, width, True)))
                launchers.FP8_INPUT_CHUNKS_PER_THREAD = default
                print(f"{name:<14}{rows:>6}{kernel:>10}{two:>17.1f}" + "".join(f"{us:>18.1f}" for us in fused))


if __name__ == "__main__":
    main()
