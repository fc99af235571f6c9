"""Prefill attention on tensor cores (GPU): TFLOP/s of prefill_attention.cu (FlashAttention-2 style) and of
attention.cu's row-split kernel on the same call, and their ratio.

The call: one sequence whose chunk of `--tokens` queries (default 8,192) sits on a cached prefix of
`--prefix` tokens (default 0: a whole prompt), block size 16, block table shuffled over the pool. Shapes:
8B (32 heads, 8 KV heads, head dim 128) and 1B (32 / 8 / 64), fp16 and bf16. FLOPs counted as
4 * D * H * (causal key-query pairs). Each figure is the median of `--repeats` CUDA-event-timed calls
after two warm-up calls (launch overhead included: one kernel per call, a few microseconds of a
millisecond-long call).

    python3 benchmarks/bench_prefill_attention.py [--tokens 8192] [--prefix 0] [--repeats 15]
        [--shapes 8b 1b] [--dtypes fp16 bf16] [--variants default d64-one-cta stages2] [--decodes 0]

--variants adds rows for patched copies of prefill_attention.cu (VARIANTS below), compiled in the same
process; the row-split figure is measured once per shape and dtype.
"""
from __future__ import annotations

import argparse
import statistics

import cupy
import ml_dtypes
import numpy as np

from offline_paged.ops import kernel_modules as modules, launchers

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # (query heads, KV heads, head dim)
DTYPES = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
BLOCK_SIZE = 16
# Source patches of cuda/prefill_attention.cu and the stage count they give the launcher (it sizes the shared
# memory): d64-one-cta lets head dim 64 use up to 255 registers (one CTA per SM, no spills) instead of two
# CTAs per SM at 128 registers (a few bytes spilled); stages2 keeps one K/V tile in flight instead of two
# (plain double buffering: a third less shared memory).
_STAGES = "constexpr int PREFILL_STAGES = 3;"
VARIANTS = {
    "default": ([], 3),
    "d64-one-cta": ([("DEFINE_PREFILL(64, 2, __half", "DEFINE_PREFILL(64, 1, __half"),
                     ("DEFINE_PREFILL(64, 2, bf16_t", "DEFINE_PREFILL(64, 1, bf16_t")], 3),
    "stages2": ([(_STAGES, _STAGES.replace("3", "2"))], 2),
}


def event_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() between two CUDA events on the current stream, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def make_call(shape, dtype, tokens: int, prefix: int, decode_contexts=(), seed: int = 0):
    """The arguments of one paged_attention call: a chunk of `tokens` queries on `prefix` cached tokens, then
    one decode query per entry of decode_contexts (a mixed step), blocks shuffled over one pool."""
    num_heads, num_kv_heads, head_dim = shape
    contexts = np.array([prefix + tokens, *decode_contexts], dtype=np.int32)  # [S]
    q_lens = np.array([tokens] + [1] * len(decode_contexts), dtype=np.int32)  # [S]
    blocks = -(-contexts // BLOCK_SIZE)  # [S]
    rng = np.random.default_rng(seed)
    pool = rng.permutation(int(blocks.sum())).astype(np.int32)
    table = np.zeros((len(contexts), int(blocks.max())), dtype=np.int32)  # [S, M]
    starts = np.concatenate([[0], np.cumsum(blocks)])
    for s, n in enumerate(blocks):
        table[s, :n] = pool[starts[s]:starts[s] + n]

    def normal(*dims):
        return cupy.random.standard_normal(dims, dtype=cupy.float32).astype(dtype)

    k_cache = normal(len(pool), BLOCK_SIZE, num_kv_heads, head_dim)  # [N, B, Hkv, D]
    v_cache = normal(len(pool), BLOCK_SIZE, num_kv_heads, head_dim)  # [N, B, Hkv, D]
    q = normal(int(q_lens.sum()), num_heads, head_dim)  # [T, H, D]
    query_start_loc = cupy.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))  # [S + 1]
    return (q, k_cache, v_cache, cupy.asarray(table), cupy.asarray(contexts), query_start_loc, tokens,
            int(contexts.max()), head_dim ** -0.5)


def causal_pairs(tokens: int, prefix: int) -> int:
    """Key-query pairs a causal chunk computes: each query sees the prefix and the chunk up to itself."""
    return tokens * prefix + tokens * (tokens + 1) // 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--prefix", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    parser.add_argument("--decodes", type=int, default=0,
                        help="add this many decode queries (contexts uniform in 100..1900) beside the chunk: a "
                             "mixed step; TFLOP/s then count the chunk's and the decodes' key-query pairs")
    args = parser.parse_args()
    decode_contexts = np.random.default_rng(1).integers(100, 1901, args.decodes).tolist()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"{props['name'].decode()}: {args.tokens}-token chunk on a {args.prefix}-token prefix"
          f"{f' beside {args.decodes} decodes' if args.decodes else ''}, block size "
          f"{BLOCK_SIZE}, shuffled table; median of {args.repeats} CUDA-event-timed calls")
    rows = []
    original, stages = modules.read_source, launchers.PREFILL_STAGES
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        flops = 4 * shape[2] * shape[0] * (causal_pairs(args.tokens, args.prefix) + sum(decode_contexts))
        for dtype_name in args.dtypes:
            call = make_call(shape, DTYPES[dtype_name], args.tokens, args.prefix, decode_contexts)
            row_split = launchers.paged_attention(*call, kernel="rowsplit").astype(cupy.float32)
            rs_ms = event_ms(lambda: launchers.paged_attention(*call, kernel="rowsplit"), args.repeats)
            for variant in args.variants:
                modules.read_source = lambda name, v=variant: (
                    modules.replaced(original(name), VARIANTS[v][0], v) if name == "prefill_attention.cu"
                    else original(name))
                launchers.PREFILL_STAGES = VARIANTS[variant][1]
                modules.clear_cache()
                launchers.clear_plans()
                out = launchers.paged_attention(*call, kernel="prefill").astype(cupy.float32)
                ms = event_ms(lambda: launchers.paged_attention(*call, kernel="prefill"), args.repeats)
                rel = float(cupy.abs(out - row_split).max()) / float(cupy.abs(row_split).max())
                rows.append((shape_name, dtype_name, variant, ms, rs_ms, flops, rel))
            modules.read_source, launchers.PREFILL_STAGES = original, stages
            modules.clear_cache()
            launchers.clear_plans()
    print(f"{'shape':>6}{'dtype':>6}{'variant':>13}{'prefill ms':>12}{'TFLOP/s':>9}{'rowsplit ms':>13}{'TFLOP/s':>9}"
          f"{'ratio':>7}{'max|diff|/max':>15}")
    for shape_name, dtype_name, variant, fa_ms, rs_ms, flops, rel in rows:
        print(f"{shape_name:>6}{dtype_name:>6}{variant:>13}{fa_ms:>12.3f}{flops / fa_ms / 1e9:>9.1f}{rs_ms:>13.3f}"
              f"{flops / rs_ms / 1e9:>9.1f}{rs_ms / fa_ms:>7.2f}{rel:>15.2e}")


if __name__ == "__main__":
    main()
