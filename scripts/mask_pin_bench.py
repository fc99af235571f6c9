"""`offline-paged` with the mask workers kept off the step loop's CPU (the session 51 experiment: on the device
host the JSON run's schedule and processing ran slower than the plain run's, as if the workers slowed the loop).

    python3 scripts/mask_pin_bench.py pin|free [DOTTED.NAME=VALUE ...] bench --structured json ...
    e.g. in a device call: BENCH="python3 scripts/mask_pin_bench.py pin" scripts/device_structured.sh

pin: at a MaskServer's first fill, the calling thread (the step loop) is pinned to the lowest CPU it may run on
and every worker process to the others, less those in PIN_AVOID (e.g. "8,9": the step loop's CPU's siblings as
scripts/cpu_sibling_probe.py finds them); free: as the OS places them (the same process otherwise, for an A/B).
"""
import os
import sys

from offline_paged.core import mask_server


def pin_at_first_fill() -> None:
    unpinned = mask_server.MaskServer.fill

    def fill(self, *args, **kwargs):
        if not getattr(self, "pinned_cpus", None):
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit(f"mask_pin_bench.py: pin needs two CPUs or more, this process may use {cpus}")
            avoid = {int(cpu) for cpu in os.environ.get("PIN_AVOID", "").split(",") if cpu.strip()}
            rest = [cpu for cpu in cpus[1:] if cpu not in avoid]
            if not rest:
                raise SystemExit(f"mask_pin_bench.py: PIN_AVOID={sorted(avoid)} leaves the workers no CPU of {cpus}")
            os.sched_setaffinity(0, {cpus[0]})  # pid 0: this thread only
            for worker in self._workers:
                os.sched_setaffinity(worker.pid, rest)
            self.pinned_cpus = (cpus[0], rest)
            placed = sorted(set().union(*(os.sched_getaffinity(worker.pid) for worker in self._workers)))
            print(f"mask_pin_bench.py: the step loop on CPUs {sorted(os.sched_getaffinity(0))}, "
                  f"{self.num_workers} mask workers on CPUs {placed}", file=sys.stderr)
        return unpinned(self, *args, **kwargs)

    mask_server.MaskServer.fill = fill


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("pin", "free"):
        raise SystemExit("usage: mask_pin_bench.py pin|free [DOTTED.NAME=VALUE ...] bench ARGS...")
    if sys.argv[1] == "pin":
        pin_at_first_fill()
    from knob_bench import run_with_knobs  # (this script's folder leads sys.path)

    run_with_knobs(sys.argv[2:])
