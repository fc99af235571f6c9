"""The two kernels around each FP8 GEMM (GPU): the per-token activation quantize and the per-token x per-channel
scale epilogue (cuda/fp8_linear.cu), scalar against 16-byte vector forms, at the 8B shape's four linears. A profile of
the FP8 8B step put them at ~2.5 ms of its 11.4 (benchmarks/RESULTS.md, 2026-12-03): are they near their bytes?

For each (linear, rows): the median of CUDA-graph replays (bench_kernels.graph_ms) of each form, GB/s of the bytes
each must move (quantize: x read once, xq written; scale: the fp32 accumulator read, the 16-bit output written),
the fraction of the device-to-device copy bandwidth measured here, and whether both forms wrote the same bytes.

    PYTHONPATH=benchmarks python3 benchmarks/bench_fp8_epilogue.py [--rows 256 64] [--preset llama-3.1-8b]
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np
from bench_kernels import copy_bandwidth_gbs, graph_ms

from offline_paged.models.dummy_weights import PRESETS
from offline_paged.ops import fp8_launcher
from offline_paged.ops.fp8_launcher import quantize_rows_fp8, scale_fp8_output
from offline_paged.ops.launchers import BFLOAT16, fp8_padded


def linears(preset: str) -> list[tuple[str, int, int]]:
    """(name, K, N) of a layer's four linears at a preset's shape."""
    c = PRESETS[preset]
    q_kv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return [("qkv", c.hidden_size, q_kv), ("o_proj", c.num_attention_heads * c.head_dim, c.hidden_size),
            ("gate_up", c.hidden_size, 2 * c.intermediate_size), ("down", c.intermediate_size, c.hidden_size)]


def timed(vector: bool, fn) -> tuple[float, object]:
    """(ms, output) of fn with fp8_launcher.VECTOR_KERNELS set to `vector`."""
    fp8_launcher.VECTOR_KERNELS = vector
    try:
        return graph_ms(fn, repeats=20), fn()
    finally:
        fp8_launcher.VECTOR_KERNELS = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[256, 64])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16")
    args = parser.parse_args()
    dtype = np.dtype(np.float16) if args.dtype == "float16" else BFLOAT16
    copy = copy_bandwidth_gbs()
    print(f"{args.preset}, {args.dtype}; copy {copy:,.0f} GB/s")
    print(f"{'linear':>8}{'rows':>6}{'kernel':>10}{'scalar us':>11}{'vector us':>11}{'vector GB/s':>13}"
          f"{'of copy':>9}{'speed-up':>10}{'same':>6}")
    rng = np.random.default_rng(0)
    for name, k, n in linears(args.preset):
        for rows in args.rows:
            x = cupy.asarray(rng.standard_normal((rows, k)).astype(dtype))  # [R, K]
            acc = cupy.asarray((rng.standard_normal((rows, fp8_padded(n))) * 1e3).astype(np.float32))  # [R, Np]
            x_scale = cupy.full(rows, 1e-3, dtype=cupy.float32)  # [R]
            w_scale = cupy.asarray(rng.uniform(1e-4, 1e-2, fp8_padded(n)).astype(np.float32))  # [Np]
            cases = [("quantize", lambda: quantize_rows_fp8(x)[0], rows * k * (dtype.itemsize + 1)),
                     ("scale", lambda: scale_fp8_output(acc, x_scale, w_scale, n, dtype),
                      rows * n * (4 + dtype.itemsize))]
            for kernel, fn, nbytes in cases:
                scalar_ms, scalar_out = timed(False, fn)
                vector_ms, vector_out = timed(True, fn)
                same = bool((scalar_out.view(cupy.uint8) == vector_out.view(cupy.uint8)).all())
                gbs = nbytes / vector_ms / 1e6
                print(f"{name:>8}{rows:>6}{kernel:>10}{scalar_ms * 1e3:>11.1f}{vector_ms * 1e3:>11.1f}{gbs:>13,.0f}"
                      f"{gbs / copy:>9.1%}{scalar_ms / vector_ms:>9.2f}x{'yes' if same else 'NO':>6}")


if __name__ == "__main__":
    main()
