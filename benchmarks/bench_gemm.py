"""The decode step's GEMMs (GPU): our capture-safe cuBLAS call (ops.graphs.CublasGemm) against torch.matmul
on the same shapes, in the same run. Is the step's non-attention time spent in cuBLAS, and would another
GEMM path help?

For each model shape and row count: the median of CUDA-graph replays (bench_kernels.graph_ms for ours;
torch's own CUDA graph for torch) of one projection, its TFLOP/s and the weight bytes per second
against the device-to-device copy bandwidth measured here. ratio = ours / torch (> 1: torch is faster).
Ours three ways: cublasGemmEx with the default algorithm (CublasGemm), cuBLASLt's first heuristic
candidate, and cuBLASLt's fastest candidate by timing (TunedGemm); tuned/Ex < 1: tuning wins.

    PYTHONPATH=benchmarks python3 benchmarks/bench_gemm.py [--rows 64 128 256] [--presets llama-3.2-1b]
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np
import torch
from bench_kernels import copy_bandwidth_gbs, graph_ms, torch_graph_ms

from offline_paged.models.dummy_weights import PRESETS
from offline_paged.ops.cublaslt import TunedGemm
from offline_paged.ops.graphs import CublasGemm


def projections(preset: str) -> list[tuple[str, int, int]]:
    """(name, K, N) of a layer's four projections and the LM head, for a preset's shape."""
    c = PRESETS[preset]
    q_kv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return [("qkv", c.hidden_size, q_kv), ("o_proj", c.num_attention_heads * c.head_dim, c.hidden_size),
            ("gate_up", c.hidden_size, 2 * c.intermediate_size), ("down", c.intermediate_size, c.hidden_size),
            ("lm_head", c.hidden_size, c.vocab_size)]


GEMMS = {"gemmEx": CublasGemm, "lt_first": lambda stream: TunedGemm(stream, tune=False), "lt_tuned": TunedGemm}


def ours(kind: str, x, w, out, out_dtype, gemms: dict):
    """One call of GEMMS[kind] on the current stream (graph_ms's capture stream; made at its warm-up call,
    where TunedGemm times its candidates)."""
    stream = cupy.cuda.get_current_stream()
    if (kind, stream.ptr) not in gemms:
        gemms[kind, stream.ptr] = GEMMS[kind](stream)
    return gemms[kind, stream.ptr](x, w, out_dtype=out_dtype, out=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--presets", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    copy = copy_bandwidth_gbs()
    gemms: dict = {}
    print(f"copy bandwidth {copy:,.0f} GB/s")
    print(f"{'preset':<14}{'proj':<9}{'rows':>6}{'Ex us':>8}{'TFLOP/s':>9}{'w of copy':>10}{'torch us':>10}{'ratio':>7}"
          f"{'Lt 1st us':>10}{'Lt tuned us':>12}{'tuned/Ex':>9}")
    for preset in args.presets:
        for name, k, n in projections(preset):
            w = cupy.random.standard_normal((k, n), dtype=cupy.float32).astype(cupy.float16)  # [K, N]
            if name == "lm_head" and PRESETS[preset].tie_word_embeddings:
                w = cupy.ascontiguousarray(w.T).T  # F-contiguous: the embedding's transpose
            w_t = torch.as_tensor(w, device="cuda")
            out_dtype = np.float32 if name == "lm_head" else None
            for rows in args.rows:
                x = cupy.random.standard_normal((rows, k), dtype=cupy.float32).astype(cupy.float16)  # [T, K]
                out = cupy.empty((rows, n), dtype=out_dtype or np.float16)
                x_t = torch.as_tensor(x, device="cuda")
                ms, first_ms, tuned_ms = (graph_ms(lambda: ours(kind, x, w, out, out_dtype, gemms), repeats=args.repeats)
                                          for kind in GEMMS)
                # torch's matmul writes fp16 (ours writes the LM head's fp32 accumulator: more bytes)
                torch_ms = torch_graph_ms(lambda: torch.matmul(x_t, w_t), args.repeats)
                flops = 2 * rows * k * n
                print(f"{preset:<14}{name:<9}{rows:>6}{ms * 1e3:>9.1f}{flops / ms / 1e9:>9.0f}"
                      f"{k * n * 2 / ms / 1e6 / copy:>10.1%}{torch_ms * 1e3:>10.1f}{ms / torch_ms:>7.2f}"
                      f"{first_ms * 1e3:>10.1f}{tuned_ms * 1e3:>12.1f}{tuned_ms / ms:>9.2f}")


if __name__ == "__main__":
    main()
