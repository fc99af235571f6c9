"""Which CPUs slow a given CPU when they are busy: a fixed pure-Python loop on the home CPU, timed alone, then with a
spinning process on each other CPU in turn, then with all of them busy at once.

Session 52's hypothesis (benchmarks/NOTES.md): the device host's 16 vCPUs, reported as one thread per core, are
hyperthreads of fewer physical cores, so a mask worker that lands on the step loop's hidden sibling slows the loop
by ~35%. A sibling shows as one CPU whose spinner alone slows home by well over the others; a shared cache or a
package clock shows as the all-busy slowdown instead. The run takes 2-3 s per home CPU on 16 CPUs.

    python3 scripts/cpu_sibling_probe.py [--home 0 [--home 8 ...]] [--repeats 3] [--passes 3] [--threshold 1.15] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

IDLE, BUSY, EXIT = 0, 1, 2
WORK = 200_000  # iterations of the timed loop: ~10 ms of one core's Python


def work(n: int = WORK) -> int:
    total = 0
    for i in range(n):
        total += i * i & 7
    return total


def _spinner(cpu: int, flags, index: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        state = flags[index]
        if state == EXIT:
            return
        if state == BUSY:
            work(2_000)
        else:
            time.sleep(0.0005)


def _timed(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def siblings(slowdowns: dict[int, float], threshold: float) -> list[int]:
    """The CPUs whose spinner alone slowed home by more than `threshold` (a ratio to home's time alone)."""
    return sorted(cpu for cpu, ratio in slowdowns.items() if ratio > threshold)


def probe(home: int, others: list[int], flags, repeats: int, passes: int) -> dict:
    """Home's loop time alone, and its slowdown with each other CPU busy and with all busy: each a median over
    `passes` of (time with them busy / time alone just before), so a drift of the host's speed cancels."""
    os.sched_setaffinity(0, {home})
    cases = [[index] for index in range(len(others))] + [list(range(len(others)))]
    ratios: list[list[float]] = [[] for _ in cases]
    alone_times = []
    for _ in range(passes):
        for case, busy in enumerate(cases):
            alone = _timed(repeats)
            for index in busy:
                flags[index] = BUSY
            time.sleep(0.005)  # the spinners wake from their sleep
            ratios[case].append(_timed(repeats) / alone)
            for index in busy:
                flags[index] = IDLE
            alone_times.append(alone)
    medians = [statistics.median(values) for values in ratios]
    return {"home": home, "alone_ms": 1e3 * statistics.median(alone_times),
            "alone_spread": max(alone_times) / min(alone_times),
            "slowdowns": dict(zip(others, medians[:-1])), "all_busy": medians[-1]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=int, action="append", help="the CPU to time on (repeatable; default: the "
                        "lowest this process may use)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per measurement (the median is kept)")
    parser.add_argument("--passes", type=int, default=3, help="passes over the CPUs (the median ratio is kept)")
    parser.add_argument("--threshold", type=float, default=1.15, help="a slowdown above it names a sibling")
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    args = parser.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    homes = args.home or [allowed[0]]
    if len(allowed) < 2 or any(home not in allowed for home in homes) or min(args.repeats, args.passes) < 1:
        raise SystemExit(f"cpu_sibling_probe.py: needs two CPUs or more, homes among {allowed}, repeats and passes >= 1")
    context = multiprocessing.get_context("fork")
    results = []
    for home in homes:
        others = [cpu for cpu in allowed if cpu != home]
        flags = context.RawArray("b", len(others))
        spinners = [context.Process(target=_spinner, args=(cpu, flags, i), daemon=True) for i, cpu in enumerate(others)]
        for spinner in spinners:
            spinner.start()
        try:
            time.sleep(0.05)
            result = probe(home, others, flags, args.repeats, args.passes)
        finally:
            for index in range(len(others)):
                flags[index] = EXIT
            for spinner in spinners:
                spinner.join(timeout=2)
            os.sched_setaffinity(0, allowed)  # (probe pinned this process to home)
        result["siblings"] = siblings(result["slowdowns"], args.threshold)
        results.append(result)
        ranked = sorted(result["slowdowns"].items(), key=lambda item: -item[1])
        print(f"home CPU {home}: alone {result['alone_ms']:.2f} ms (max/min {result['alone_spread']:.2f}); "
              f"all {len(others)} others busy {result['all_busy']:.2f}x; siblings (> {args.threshold}x): "
              f"{result['siblings'] or 'none'}")
        print("  one CPU busy, slowest first: " + ", ".join(f"{cpu}: {ratio:.2f}x" for cpu, ratio in ranked))
    if args.json:
        print(json.dumps({"cpus": allowed, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
