"""Decode attention by batch size and key-split count (GPU): what the split planner should choose for small batches.

The decode graphs' launch: one query row per sequence, the "decode" tiles, max_context_len the static bound (1,900
keys; short contexts leave splits empty), sequences launched longest first, contexts uniform in 600..1900 (a run's
tail), shuffled block tables. Prints us per launch (graph replays, median of 30; the split merge and its workspace
memset included) for each batch size and forced split count, and the planner's choice with its count in brackets.
One shape per process (`fp8` suffix: an e4m3 cache with scales 1.0): two in one process once hit an illegal address.

    PYTHONPATH=benchmarks python3 benchmarks/decode_split_sweep.py qwen3|8b|1b|qwen3fp8|8bfp8|1bfp8

Measured on the H200, session 36: benchmarks/RESULTS.md (it ran as a session script before it was kept here).
"""
import sys

import cupy
import numpy as np
from bench_decode_splits import random_e4m3, shuffled_tables
from bench_kernels import graph_ms, random_f16

from offline_paged.ops import launchers, step_inputs_launcher

SHAPES = {"qwen3": (128, 16, 8), "8b": (128, 32, 8), "1b": (64, 32, 8)}
SHAPES.update({k + "fp8": v for k, v in SHAPES.items()})
BATCHES = [8, 16, 24, 32, 48, 64, 96, 128, 192]
SPLITS = [None, 1, 2, 3, 4, 6]
BOUND = 1900
if len(sys.argv) != 2 or sys.argv[1] not in SHAPES:
    raise SystemExit(f"usage: decode_split_sweep.py SHAPE, one of {sorted(SHAPES)}")
shape = sys.argv[1]
d, h, hkv = SHAPES[shape]
rng = np.random.default_rng(0)
block = 16
lens = rng.integers(600, BOUND + 1, max(BATCHES))
tables, num_blocks = shuffled_tables(rng, lens, block, BOUND)
fp8 = shape.endswith("fp8")
new_cache = random_e4m3 if fp8 else random_f16
kv_scale = cupy.ones(2, dtype=cupy.float32) if fp8 else None
k_cache = new_cache(num_blocks * block * hkv * d).reshape(num_blocks, block, hkv, d)
v_cache = new_cache(num_blocks * block * hkv * d).reshape(num_blocks, block, hkv, d)
print(f"== {shape}: D {d}, {h}/{hkv} heads, contexts 600..{BOUND}; us per launch (splits: plan's count in brackets)")
print(f"{'batch':>6}" + "".join(f"{'plan' if s is None else s:>9}" for s in SPLITS))
for b in BATCHES:
    q = random_f16(b * h * d).reshape(b, h, d)
    tables_d, lens_d = cupy.asarray(tables[:b]), cupy.asarray(lens[:b].astype(np.int32))
    qsl = cupy.arange(b + 1, dtype=cupy.int32)
    order = cupy.empty(b, dtype=cupy.int32)
    step_inputs_launcher.launch_order(lens_d, order)
    row = f"{b:>6}"
    for s in SPLITS:
        def run(s=s):
            return launchers.paged_attention(q, k_cache, v_cache, tables_d, lens_d, qsl, 1, BOUND, d ** -0.5,
                                             num_splits=s, launch_order=order, kernel="decode",
                                             kv_scale=kv_scale)
        ms = graph_ms(run, repeats=30)
        if s is None:
            plan = launchers._plan_attention(q.shape, k_cache.shape, v_cache.shape, tables_d.shape, b, b + 1, b,
                                             1, BOUND, None, 0, "decode", "f16", fp8)
            row += f"{1000 * ms:>6.1f}[{plan.num_splits}]"
        else:
            row += f"{1000 * ms:>9.1f}"
    print(row, flush=True)
