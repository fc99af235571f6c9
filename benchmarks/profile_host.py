"""Where the host time of a bench run goes, function by function (cProfile), to find the calls that
wait for the device (a copy from pageable memory, a synchronize, an allocation that frees the pool).

Runs `offline-paged bench` in this process under cProfile and prints the functions with the most own
time and the most cumulative time. cProfile slows Python-heavy code, so read it for where the host
waits and for relative costs, not for absolute step times.

    python benchmarks/profile_host.py [--top 30] -- --dummy-weights llama-3.2-1b --num-requests 1024
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

from offline_paged.cli.main import cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    profiler = cProfile.Profile()
    profiler.enable()
    cli(["bench", "--device", "cuda", *bench_args], standalone_mode=False)
    profiler.disable()
    stats = pstats.Stats(profiler)
    for key in ("tottime", "cumulative"):
        print(f"\n== top {args.top} by {key}")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
