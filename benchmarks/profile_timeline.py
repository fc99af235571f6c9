"""Is a bench run's device busy, or does it wait for the host? (GPU only.)

Runs `offline-paged bench` in this process with one of its timed runs (`run_bench` call number --run; not the
warm-up, capture or ceilings) under torch's profiler: kernels, copies and memsets through CUPTI, and the CUDA
runtime and driver calls that launched them. Prints for the device's last stretch of activity in it (a pause
of more than --pause-ms ends a stretch) how much of it the device was busy, its idle gaps by length,
the longest gaps (where, what ran around them and what the host called meanwhile), the host calls' time,
and the kernels that took the most time. A device idle between kernels while the host launches is a
host-paced run; a busy one is bound by its kernels.

    python benchmarks/profile_timeline.py [--run 1] [--first-ms 420] [--trace out.json] -- \
        --dummy-weights qwen3-0.6b --cuda-graphs --no-roofline

Everything after `--` goes to `offline-paged bench` unchanged.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

import offline_paged.benchmark.bench as bench_module
from offline_paged.cli.main import cli

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_BINS_US = (10, 100, 1000, 10000)
LONGEST_GAPS = 12


def stretches(intervals: list[tuple[float, float]], pause_us: float) -> list[list[tuple[float, float]]]:
    """Sorted (start, end) intervals split where the device pauses longer than pause_us."""
    groups: list[list[tuple[float, float]]] = []
    end = None
    for start, stop in intervals:
        if end is None or start - end > pause_us:
            groups.append([])
        groups[-1].append((start, stop))
        end = stop if end is None else max(end, stop)
    return groups


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """The union of sorted intervals (us) and the idle gaps between them."""
    busy, gaps = 0.0, []
    cur_start, cur_end = intervals[0]
    for start, stop in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(start - cur_end)
            cur_start, cur_end = start, stop
        else:
            cur_end = max(cur_end, stop)
    busy += cur_end - cur_start
    return busy, gaps


def report(events: list[dict], pause_ms: float, top: int, first_ms: float | None = None) -> None:
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                    key=lambda e: e["ts"])
    if not device:
        print("no device activity recorded")
        return
    groups = stretches([(e["ts"], e["ts"] + e["dur"]) for e in device], pause_ms * 1e3)
    print(f"{len(groups)} stretch(es) of device activity: " +
          ", ".join(f"{(g[-1][1] - g[0][0]) / 1e3:.0f} ms" for g in groups[-8:]) + " (last 8)")
    last = groups[-1]
    if first_ms is not None:  # only its first first_ms (the prefilling steps at the start of a run)
        last = [(start, stop) for start, stop in last if start < last[0][0] + first_ms * 1e3]
    t0, t1 = last[0][0], max(stop for _, stop in last)
    busy, gaps = busy_and_gaps(last)
    span = max(t1 - t0, 1e-9)
    print(f"last stretch{'' if first_ms is None else f', its first {first_ms:g} ms'}: {span / 1e3:.1f} ms, device busy {busy / 1e3:.1f} ms ({busy / span:.1%}), "
          f"idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps")
    for low, high in zip((0, *GAP_BINS_US), (*GAP_BINS_US, float("inf"))):
        chosen = [g for g in gaps if low <= g < high]
        print(f"  gaps {low:>5}-{high:<6} us: {len(chosen):>7} of them, {sum(chosen) / 1e3:9.2f} ms")
    calls = sorted((e for e in events if e.get("ph") == "X" and "cuda" in str(e.get("cat", ""))
                    and e.get("cat") not in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    in_stretch = [e for e in device if t0 <= e["ts"] <= t1]
    print(f"the {LONGEST_GAPS} longest gaps (at ms from the stretch's start: length; kernel before -> after; "
          "host calls that started in the gap, longest first):")
    ranked = sorted(range(1, len(in_stretch)), key=lambda i: in_stretch[i - 1]["ts"] + in_stretch[i - 1]["dur"]
                    - in_stretch[i]["ts"])
    for i in sorted(ranked[:LONGEST_GAPS], key=lambda i: in_stretch[i]["ts"]):
        before, after = in_stretch[i - 1], in_stretch[i]
        start, stop = before["ts"] + before["dur"], after["ts"]
        if stop <= start:
            continue
        inside = sorted((e for e in calls if start <= e["ts"] < stop), key=lambda e: -e["dur"])
        names = ", ".join(f"{e['name']} {e['dur'] / 1e3:.2f}" for e in inside[:3])
        print(f"  {(start - t0) / 1e3:8.1f}: {(stop - start) / 1e3:6.2f} ms; {_short(before['name'])} -> "
              f"{_short(after['name'])}; {len(inside)} calls: {names}")
    host = defaultdict(lambda: [0, 0.0, 0.0])  # name -> [calls, total us, max us]
    for e in calls:
        if t0 <= e["ts"] <= t1:
            entry = host[e["name"]]
            entry[0] += 1
            entry[1] += e["dur"]
            entry[2] = max(entry[2], e["dur"])
    print("host calls in the stretch (calls, total ms, mean us, max us):")
    for name, (calls, total, most) in sorted(host.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {name[:40]:<40} {calls:>8} {total / 1e3:9.2f} {total / calls:8.1f} {most:9.1f}")
    kernels = defaultdict(lambda: [0, 0.0])
    for e in device:
        if t0 <= e["ts"] <= t1:
            entry = kernels[_short(e["name"])]
            entry[0] += 1
            entry[1] += e["dur"]
    print("device time in the stretch (launches, total ms, mean us, share of busy):")
    for name, (calls, total) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {name:<60} {calls:>8} {total / 1e3:9.2f} {total / calls:8.1f} {total / busy:7.1%}")


def _short(name: str) -> str:
    """cuBLAS and CUTLASS names are long templates: the part before the first '<' or '('."""
    return name.split("<")[0].split("(")[0][:60]


def profiled(run_bench, which: int, holder: list):
    """run_bench with its call number `which` (0 = the first) under the profiler, whose profile is appended
    to holder. Only one: a second profiler session in the same process recorded no kernels (H200, session 37)."""
    calls = iter(range(1_000_000))

    def run(*args, **kwargs):
        if next(calls) != which:
            return run_bench(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = run_bench(*args, **kwargs)
        holder.append(prof)
        return result

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--pause-ms", type=float, default=50.0)
    parser.add_argument("--first-ms", type=float, default=None, help="then the stretch's first ms alone")
    parser.add_argument("--run", type=int, default=0, help="which timed run to profile (0 = the first)")
    parser.add_argument("--trace", type=Path, default=None, help="keep the Chrome trace here")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    profiles: list = []
    bench_module.run_bench = profiled(bench_module.run_bench, args.run, profiles)
    cli(["bench", "--device", "cuda", *bench_args], standalone_mode=False)
    if not profiles:
        raise SystemExit(f"the bench ran no timed run number {args.run}")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace or Path(tmp) / "trace.json"
        profiles[0].export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    report(events, args.pause_ms, args.top)
    if args.first_ms is not None:
        print()
        report(events, args.pause_ms, args.top, args.first_ms)


if __name__ == "__main__":
    main()
