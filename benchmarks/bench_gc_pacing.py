"""The step loop's collector pacing against CPython's own thresholds, in one process: bench_host_step's workload
run PAIRS times each way, the order alternating, and the whole host step of each run (the collector's pauses in it
too), then each pair's ratio default / paced and their median.

    python benchmarks/bench_gc_pacing.py PAIRS [bench_host_step options, e.g. --graphs --dataset sharegpt-like
                                                --num-requests 1024 --clock cpu]

Separate processes on a shared 2-core machine spread by +-30%; runs alternating in one process see the same
machine, so the pairs' ratios are what to quote.
"""
from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_host_step", Path(__file__).with_name("bench_host_step.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def main() -> None:
    pairs, options = int(sys.argv[1]), sys.argv[2:]
    runs: dict[str, list[tuple[float, float]]] = {"default": [], "paced": []}  # (step ms, collector ms a step)
    for index in range(pairs):
        for side in ("default", "paced") if index % 2 == 0 else ("paced", "default"):
            steps, totals = bench.run_once(bench.parse_args([*options, "--gc", side]))
            runs[side].append((1e3 * totals["whole step"] / steps, 1e3 * totals.get("gc pauses", 0.0) / steps))
            print(f"pair {index + 1} {side:<8} {steps} steps: {runs[side][-1][0]:.3f} ms a step, "
                  f"collector {runs[side][-1][1]:.3f} ms", flush=True)
    for side, values in runs.items():
        print(f"{side:<8} median step {statistics.median(v for v, _ in values):.3f} ms, "
              f"collector {statistics.median(c for _, c in values):.3f} ms a step")
    ratios = [d / p for (d, _), (p, _) in zip(runs["default"], runs["paced"])]
    print("default / paced, each pair:", ", ".join(f"{r:.3f}" for r in ratios),
          f"| median {statistics.median(ratios):.3f}, paced faster in {sum(r > 1 for r in ratios)} of {pairs}")


if __name__ == "__main__":
    main()
