"""How many CTAs share one row of a row-per-block kernel (silu_mul_fp8), and their threads: plain arithmetic, so CPU
tests can check it; ops/launchers.py launches by it.

A kernel that quantizes its output rows needs each row's amax before it writes a byte, so a row is one block's work,
or one thread block cluster's (sm_90: the CTAs of a cluster read each other's shared memory, layer.cu's row_amax).
Its time is the busiest SM's: a decode step of 136 rows on 132 SMs puts two rows on 4 SMs and takes two rows' time,
as 256 rows do; 64 rows leave 68 SMs idle. Split in `k`, the busiest SM holds ceil(rows k / SMs) pieces of 1/k row.
"""
from __future__ import annotations

import math

SPLITS = (1, 2, 4)  # the cluster sizes layer.cu defines (silu_mul_fp8_product's _x2 / _x4 kernels)
MANY_ROWS = 2  # past this many rows an SM, waves balance the work by themselves: one block a row


def busiest_sm_rows(num_rows: int, split: int, num_sms: int) -> float:
    """The rows' worth of work on the busiest SM with `split` CTAs a row, all of them resident at once."""
    return math.ceil(num_rows * split / num_sms) / split


def row_split(num_rows: int, num_sms: int, splits: tuple[int, ...] = SPLITS) -> int:
    """The split of `splits` that leaves the busiest SM the least work (the smaller split on a tie); 1 for more than
    MANY_ROWS rows an SM, or when splits offers nothing else (no clusters before sm_90)."""
    if num_rows < 1 or num_rows > MANY_ROWS * num_sms:
        return 1
    return min(splits, key=lambda k: (busiest_sm_rows(num_rows, k, num_sms), k))


def split_threads(units: int, num_rows: int, split: int, num_sms: int, resident_threads: int = 1024) -> int:
    """Threads a CTA for `split` CTAs a row of `units` work items, so that the busiest SM's pieces are resident
    together (`resident_threads` an SM: the kernels' ~64 registers a thread allow 1024): a multiple of 32, enough for
    one item a thread where that fits."""
    pieces = math.ceil(num_rows * split / num_sms)
    cap = max(32, resident_threads // pieces // 32 * 32)
    return min(cap, max(32, math.ceil(math.ceil(units / split) / 32) * 32))
