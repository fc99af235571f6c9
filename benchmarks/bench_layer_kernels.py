"""Kernel benchmark (GPU): the elementwise decoder-layer kernels of cuda/layer.cu (rms_norm with a residual,
rope on strided q/k views of a fused qkv row, silu_mul) at decode-step shapes of Llama-3.2-1B and
Llama-3.1-8B, fp16, T = 256 tokens.

Each point: the calls are captured into one CUDA graph that cycles over enough separate input/output sets
(>= ~256 MB in all) that no call finds its inputs in the 50 MB L2, and the graph is replayed; the figure is
the median over replays of replay time / calls, after warm-up. GB/s = bytes read + written per call / time.
The device-to-device copy bandwidth measured the same way is the peer.

    python benchmarks/bench_layer_kernels.py     (bench_kernels.graph_ms does the capture and the timing)
"""
from __future__ import annotations

import math

import cupy
import numpy as np
from bench_kernels import graph_ms

from offline_paged.ops import launchers

NUM_TOKENS = 256
SHAPES = {  # name: (hidden, intermediate, q heads, kv heads, head dim)
    "llama-3.2-1b": (2048, 8192, 32, 8, 64),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128),
}
SWEEP_BYTES = 256 << 20  # the input/output sets of one graph together move at least this much
MAX_SETS = 64
REPLAYS = 50
MAX_POSITIONS = 4096


def graph_us(calls) -> float:
    """Median over REPLAYS of (one replay of a graph running every call once) / len(calls), in µs."""
    keep = []  # outputs stay alive, so every call in the graph writes its own buffers
    return graph_ms(lambda: keep.extend(call() for call in calls), REPLAYS) * 1e3 / len(calls)


def num_sets(bytes_per_call: int) -> int:
    return max(2, min(MAX_SETS, math.ceil(SWEEP_BYTES / bytes_per_call)))


def randn(*shape):
    return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)


def bench_rms_norm(hidden: int) -> tuple[float, int]:
    nbytes = 2 * (4 * NUM_TOKENS * hidden + hidden)  # x, residual, weight in; out, residual_out
    weight = randn(hidden)
    sets = [(randn(NUM_TOKENS, hidden), randn(NUM_TOKENS, hidden)) for _ in range(num_sets(nbytes))]
    return graph_us([lambda x=x, r=r: launchers.rms_norm(x, weight, 1e-5, r) for x, r in sets]), nbytes


def bench_silu_mul(inter: int) -> tuple[float, int]:
    nbytes = 2 * 3 * NUM_TOKENS * inter  # gate_up [T, 2I] in, out [T, I]
    sets = [randn(NUM_TOKENS, 2 * inter) for _ in range(num_sets(nbytes))]
    return graph_us([lambda g=g: launchers.silu_mul(g) for g in sets]), nbytes


def bench_rope(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[float, int]:
    nbytes = 2 * (2 * NUM_TOKENS * (num_heads + num_kv_heads) * head_dim + NUM_TOKENS * head_dim)
    table = randn(MAX_POSITIONS, head_dim)  # [P, D] concat(cos, sin); values do not matter for timing
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    calls = []
    for _ in range(num_sets(nbytes)):
        qkv = randn(NUM_TOKENS, q_width + 2 * kv_width)  # the fused projection's output
        q = qkv[:, :q_width].reshape(NUM_TOKENS, num_heads, head_dim)
        k = qkv[:, q_width:q_width + kv_width].reshape(NUM_TOKENS, num_kv_heads, head_dim)
        positions = cupy.asarray(np.random.default_rng(0).integers(0, MAX_POSITIONS, NUM_TOKENS, dtype=np.int32))
        calls.append(lambda q=q, k=k, p=positions: launchers.rope(q, k, p, table))
    return graph_us(calls), nbytes


def bench_copy() -> tuple[float, int]:
    n = 8 << 20  # 16 MB fp16 per copy
    sets = [(randn(n), cupy.empty(n, cupy.float16)) for _ in range(num_sets(4 * n))]
    return graph_us([lambda s=s, d=d: cupy.copyto(d, s) for s, d in sets]), 4 * n


def main() -> None:
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    print(f"device: {name.decode() if isinstance(name, bytes) else name}, fp16, T={NUM_TOKENS}")
    print(f"{'shape':<14} {'kernel':<42} {'us':>8} {'MB':>7} {'GB/s':>8}")

    def row(shape: str, kernel: str, us: float, nbytes: int) -> None:
        print(f"{shape:<14} {kernel:<42} {us:8.2f} {nbytes / 1e6:7.2f} {nbytes / us / 1e3:8.0f}")

    row("-", "device-to-device copy (16 MB)", *bench_copy())
    for shape, (hidden, inter, heads, kv_heads, head_dim) in SHAPES.items():
        row(shape, f"rms_norm_f16 E={hidden} +residual", *bench_rms_norm(hidden))
        row(shape, f"silu_mul_f16 I={inter}", *bench_silu_mul(inter))
        row(shape, f"rope_same_cache_f16 H={heads} Hkv={kv_heads} D={head_dim}",
            *bench_rope(heads, kv_heads, head_dim))


if __name__ == "__main__":
    main()
