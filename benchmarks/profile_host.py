"""Where the host time of a bench run goes, function by function (cProfile), to find the calls that
wait for the device (a copy from pageable memory, a synchronize, an allocation that frees the pool).

Runs `offline-paged bench` in this process under cProfile and prints the functions with the most own
time and the most cumulative time. cProfile slows Python-heavy code, so read it for where the host
waits and for relative costs, not for absolute step times.

    python benchmarks/profile_host.py [--top 30] -- --dummy-weights llama-3.2-1b --num-requests 1024
    python benchmarks/profile_host.py --per-run [--top 30] -- --dummy-weights llama-3.2-1b --structured json

--per-run profiles each of the bench's runs apart (only the timed step loop, not the engine's start or
warm-up) and prints each function's own time in microseconds per engine step for every run, side by side,
sorted by the largest difference between two runs (--diff A B: run A minus run B, indices as printed; by
default the second run minus the last, which with --structured json is what the constrained run's step loop
spends that the like-for-like plain run, `plain@json lengths`, does not).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

from offline_paged.cli.main import cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--per-run", action="store_true", help="profile each run's step loop apart, side by side")
    parser.add_argument("--diff", type=int, nargs=2, metavar=("A", "B"), default=(1, -1),
                        help="with --per-run: sort by run A's own time minus run B's (default: 1 -1)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench_args = ["bench", "--device", "cuda", *[a for a in args.bench_args if a != "--"]]
    if args.per_run:
        print_per_run(profile_each_run(bench_args), args.top, args.diff)
        return
    profiler = cProfile.Profile()
    profiler.enable()
    cli(bench_args, standalone_mode=False)
    profiler.disable()
    stats = pstats.Stats(profiler)
    for key in ("tottime", "cumulative"):
        print(f"\n== top {args.top} by {key}")
        stats.sort_stats(key).print_stats(args.top)


def profile_each_run(bench_args: list[str]) -> list[tuple[str, int, dict]]:
    """Run the bench with `run_bench` profiled call by call: (label, steps, {function: own seconds}) per run."""
    from offline_paged.benchmark import bench

    runs = []
    unprofiled = bench.run_bench

    def profiled(engine, requests, **kwargs):
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            result = unprofiled(engine, requests, **kwargs)
        finally:
            profiler.disable()
        own = {pstats.func_std_string(func): row[2] for func, row in pstats.Stats(profiler).stats.items()}
        runs.append((kwargs.get("label", ""), max(1, len(result.steps)), own))
        return result

    bench.run_bench = profiled
    try:
        cli(bench_args, standalone_mode=False)
    finally:
        bench.run_bench = unprofiled
    return runs


def print_per_run(runs: list[tuple[str, int, dict]], top: int, diff: tuple[int, int] = (1, -1)) -> None:
    if not runs:
        raise SystemExit("profile_host.py: the bench ran no runs")
    try:
        a, b = [range(len(runs))[i] for i in diff]
    except IndexError:
        raise SystemExit(f"profile_host.py: --diff {diff[0]} {diff[1]}: the bench ran {len(runs)} run(s)") from None
    per_step = [{func: seconds * 1e6 / steps for func, seconds in own.items()} for _, steps, own in runs]
    funcs = set().union(*per_step)
    run_a, run_b = per_step[a], per_step[b]
    order = sorted(funcs, key=lambda f: -abs(run_a.get(f, 0.0) - run_b.get(f, 0.0)))
    print("own time, us per step; runs: " + "; ".join(f"[{i}] {label} ({steps} steps)"
                                                     for i, (label, steps, _) in enumerate(runs)))
    print("".join(f"{f'[{i}]':>9}" for i in range(len(runs))) + f"{f'[{a}]-[{b}]':>11}  function")
    print("".join(f"{sum(p.values()):>9.1f}" for p in per_step)
          + f"{sum(run_a.values()) - sum(run_b.values()):>11.1f}  (all)")
    for func in order[:top]:
        print("".join(f"{p.get(func, 0.0):>9.1f}" for p in per_step)
              + f"{run_a.get(func, 0.0) - run_b.get(func, 0.0):>11.1f}  {func}")


if __name__ == "__main__":
    main()
