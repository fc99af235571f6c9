"""Kernel benchmark (GPU): an FP8 linear's input made by one kernel (layer.cu's rms_norm_fp8 / silu_mul_fp8) against
the two launches it replaces (rms_norm or silu_mul, then fp8_launcher.quantize_rows_fp8), at the decode shapes of
Llama-3.2-1B and Llama-3.1-8B in bf16, with the launchers' rule for threads per row (launchers.fp8_input_threads)
and with launchers.FP8_INPUT_CHUNKS_PER_THREAD forced to 1, 2, 4.
--product: the forms the FP8 model runs, reading the previous FP8 GEMM's bfloat16 sums with its per-token and
per-channel scales (`product=`), against their bytes at the copy bandwidth (session 55's profile: silu_mul_fp8's
at ~16 us a decode step of 136 rows at the 8B shape, ~5x its bytes).
Timing as bench_layer_kernels.py (graph replays over input sets larger than L2; median us per call).

    python benchmarks/bench_fp8_inputs.py [--rows 256 64] [--product]
"""
from __future__ import annotations

import argparse

import cupy
import ml_dtypes
import numpy as np
from bench_kernels import copy_bandwidth_gbs
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


def product(rows: int, width: int):
    """An FP8 GEMM's product before its epilogue: (acc [R, width] bfloat16, x_scale [R], w_scale [width], width)."""
    acc = randn(rows, width)
    x_scale = cupy.random.uniform(1e-3, 1e-2, rows, dtype=cupy.float32)
    w_scale = cupy.random.uniform(1e-4, 1e-2, width, dtype=cupy.float32)
    return acc, x_scale, w_scale, width


def product_rows(rows: int, hidden: int, inter: int, copy_gbs: float) -> list[tuple[str, float, float]]:
    """(kernel, us, bytes us) of the product-reading rms_norm_fp8 (with a residual) and silu_mul_fp8 at one shape:
    bytes = the sums read, the residual read and written, xq written (the scales stay in L2)."""
    weight = randn(hidden)
    norm_sets = [(product(rows, hidden), randn(rows, hidden)) for _ in range(num_sets(9 * rows * hidden))]
    silu_sets = [product(rows, 2 * inter) for _ in range(num_sets(5 * rows * inter))]
    norm = graph_us([lambda p=p, r=r: launchers.rms_norm_fp8(None, weight, 1e-5, r, product=p) for p, r in norm_sets])
    silu = graph_us([lambda p=p: launchers.silu_mul_fp8(None, product=p, dtype=BF16) for p in silu_sets])
    norm_bytes, silu_bytes = rows * hidden * (2 + 2 + 2 + 1), rows * inter * (2 * 2 + 1)
    return [("rms_norm", norm, norm_bytes / copy_gbs / 1e3), ("silu_mul", silu, silu_bytes / copy_gbs / 1e3)]


def main_product(rows_list: list[int]) -> None:
    copy_gbs = copy_bandwidth_gbs()
    print(f"product-reading forms (bfloat16 sums), bf16; copy {copy_gbs:,.0f} GB/s")
    print(f"{'shape':<14}{'rows':>6}{'kernel':>10}{'us':>9}{'bytes us':>10}{'of copy':>9}")
    for name, (hidden, inter, *_) in SHAPES.items():
        for rows in rows_list:
            for kernel, us, bytes_us in product_rows(rows, hidden, inter, copy_gbs):
                print(f"{name:<14}{rows:>6}{kernel:>10}{us:>9.1f}{bytes_us:>10.1f}{bytes_us / us:>9.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--product", action="store_true", help="the product-reading forms against their bytes")
    args = parser.parse_args()
    if args.product:
        main_product(args.rows)
        return
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
