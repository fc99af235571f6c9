"""Where the GPU time of a bench run goes, kernel by kernel (GPU only).

Runs `offline-paged bench` in this process under torch's profiler, which records every CUDA kernel
the process launches through CUPTI (CuPy's RawKernels and cuBLAS included, also inside CUDA graph
replays), and prints the kernels that took the most device time: total ms, launches, mean µs and the
share of all kernel time. The bench's own figures print first, as usual.

    python benchmarks/profile_kernels.py [--top 25] -- --dummy-weights llama-3.2-1b --no-roofline

Everything after `--` goes to `offline-paged bench` unchanged. Warm-up, graph capture and the
ceilings measurement are in the profile too: pass --no-roofline to leave the last out. Last come the
launch gaps: the idle spans shorter than --gap-us between two kernels of one stream, in all and by the
pair of kernels around them (what programmatic dependent launch could hide).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from offline_paged.cli.main import cli


def short_name(name: str) -> str:
    """cuBLAS and CUTLASS names are long templates: keep the part before the first '<' or '('."""
    return re.split(r"[<(]", name, maxsplit=1)[0][:70]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--gap-us", type=float, default=20.0,
                        help="idle spans between two kernels of one stream shorter than this count as launch gaps")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cli(["bench", "--device", "cuda", *bench_args], standalone_mode=False)
    total_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    events = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    for event in events:
        key = short_name(event["name"])
        total_us[key] += event.get("dur", 0.0)
        count[key] += 1
    grand = sum(total_us.values())
    print(f"\nkernel time over the whole run: {grand / 1e3:,.1f} ms")
    print(f"{'kernel':<72}{'total ms':>10}{'calls':>9}{'mean us':>9}{'share':>8}")
    for key, us in sorted(total_us.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{key:<72}{us / 1e3:>10.1f}{count[key]:>9}{us / count[key]:>9.1f}{us / grand:>8.1%}")
    print_gaps(events, args.gap_us, args.top)


def print_gaps(events: list[dict], gap_us: float, top: int) -> None:
    """The idle time between consecutive kernels of one stream, where it is shorter than `gap_us` (a launch's
    latency inside a graph or a busy stream, not the host's waits): in all, and by (kernel before, kernel after)."""
    by_stream: dict = defaultdict(list)
    for event in events:
        by_stream[(event.get("args", {}).get("device"), event.get("args", {}).get("stream"))].append(event)
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
    for stream_events in by_stream.values():
        stream_events.sort(key=lambda e: e["ts"])
        for before, after in zip(stream_events, stream_events[1:]):
            gap = after["ts"] - (before["ts"] + before.get("dur", 0.0))
            if 0.0 <= gap < gap_us:
                gaps[(short_name(before["name"])[:34], short_name(after["name"])[:34])].append(gap)
    every = [g for values in gaps.values() for g in values]
    if not every:
        return
    print(f"\nlaunch gaps (< {gap_us:g} us between kernels of one stream): {sum(every) / 1e3:,.1f} ms over "
          f"{len(every):,} boundaries, median {statistics.median(every):.2f} us")
    print(f"{'kernel before -> kernel after':<72}{'total ms':>10}{'count':>9}{'median us':>10}")
    for (before, after), values in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{before + ' -> ' + after:<72}{sum(values) / 1e3:>10.1f}{len(values):>9}"
              f"{statistics.median(values):>10.2f}")


if __name__ == "__main__":
    main()
