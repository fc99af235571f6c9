"""The decode graph's sampler kernels by row count (GPU): race_logits (and top_cut_logits) over fp32 logits of a
Llama 3 vocabulary, every row random (temperature 1, no top-k / top-p, as `offline-paged bench`), timed as CUDA
graph replays (bench_kernels.graph_ms). Prints µs per launch and the GB/s of the logits read, for source
variants of cuda/sampling.cu compared in one process (the first variant's tokens are the reference).

    PYTHONPATH=benchmarks python3 benchmarks/bench_sampling.py [--rows 64 136 256] [--vocab 128256]
        [--variants default nostats nolog]
"""
from __future__ import annotations

import argparse

import cupy
import numpy as np
from bench_kernels import graph_ms

from offline_paged.ops import kernel_modules as modules
from offline_paged.ops import sampling_launcher as kernels
from offline_paged.sampling_params import SamplingParams
from offline_paged.worker.sampling_rows import pack_params

_SCORE = "return y - log_exponential(stream_bits(base, (unsigned long long)i));"
_SPLIT = "constexpr int RACE_SPLIT = "
_LOADS = "constexpr int RACE_ROW_LOADS = "
# Source variants (patches, the launcher's RACE_SPLIT). What each part of the race's per-entry work costs (their
# tokens differ from the default's): no raw (max, lse), no logs, no random numbers (the last two make near-ties
# common, so threads rescan: an upper bound, not a floor). Then the row over 4 or 16 blocks; 4 or 16 loads in flight
# per thread.
VARIANTS = {
    "default": ([], 8),
    "nostats": ([("stats.add(raw_x);", "")], 8),
    "nolog": ([(_SCORE, "return y + (float)(stream_bits(base, (unsigned long long)i) & 1);")], 8),
    "norandom": ([(_SCORE, "return y;")], 8),
    "split4": ([(_SPLIT + "8;", _SPLIT + "4;")], 4),
    "split16": ([(_SPLIT + "8;", _SPLIT + "16;")], 16),
    "loads4": ([(_LOADS + "8;", _LOADS + "4;")], 8),
    "loads16": ([(_LOADS + "8;", _LOADS + "16;")], 8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 132, 136, 200, 256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    max_rows, vocab = max(args.rows), args.vocab
    logits = cupy.asarray((rng.normal(size=(max_rows, vocab)) * 2.0).astype(np.float32))  # [R, V]
    params_all = cupy.asarray(pack_params([SamplingParams(temperature=1.0)] * max_rows))  # [R, 8]
    seeds_all = cupy.asarray(rng.integers(0, 2**63, max_rows, dtype=np.uint64))  # [R]
    positions_all = cupy.asarray(rng.integers(0, 2000, max_rows).astype(np.uint64))  # [R]
    print(f"vocab {vocab}, fp32 logits, temperature 1.0, no top-k / top-p; µs per launch (graph replays)")
    print(f"{'variant':>10}{'rows':>6}{'race us':>10}{'GB/s':>8}{'top_cut us':>12}{'tokens = first':>16}")
    original, split = modules.read_source, getattr(kernels, "RACE_SPLIT", 1)
    reference: dict[int, np.ndarray] = {}
    try:
        for variant in args.variants:
            modules.read_source = lambda name, v=variant: (
                modules.replaced(original(name), VARIANTS[v][0], v) if name == "sampling.cu" else original(name))
            modules.clear_cache()
            kernels.RACE_SPLIT = VARIANTS[variant][1]
            for num_rows in args.rows:
                rows = cupy.arange(num_rows, dtype=cupy.int32)
                params, seeds, positions = params_all[:num_rows], seeds_all[:num_rows], positions_all[:num_rows]
                cut, out = cupy.empty(num_rows), cupy.empty((num_rows, 2))

                def race():
                    kernels.race_logits(cut, logits, rows, params, seeds, positions, out)

                def top_cut():
                    kernels.top_cut_logits(logits, rows, params, cut)

                top_cut()
                race()
                tokens = out[:, 0].get()
                same = reference.setdefault(num_rows, tokens)
                race_us, cut_us = graph_ms(race, repeats=50) * 1e3, graph_ms(top_cut, repeats=50) * 1e3
                gbs = num_rows * vocab * 4 / race_us / 1e3
                print(f"{variant:>10}{num_rows:>6}{race_us:>10.1f}{gbs:>8.0f}{cut_us:>12.1f}"
                      f"{int((same == tokens).sum()):>12}/{num_rows}")
    finally:
        modules.read_source = original
        kernels.RACE_SPLIT = split
        modules.clear_cache()


if __name__ == "__main__":
    main()
