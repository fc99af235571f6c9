"""What the host did to the step loop's thread over one bench run: its CPU time, its context switches and the
VM's steal time.

Session 52's H200 runs of the JSON bench spread from 0.81 to 0.96 like for like, and the JSON run's own host time
(schedule, execute) decided where (benchmarks/NOTES.md). A slower loop could be a slower CPU under it (the VM's
steal, a busy hyperthread sibling: CPU time per step grows) or time off the CPU (preemption: involuntary switches
grow, CPU time does not). These counters tell them apart. Linux only: elsewhere a counter is None.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

try:
    import resource  # (POSIX only)
except ImportError:
    resource = None

PROC_STAT = "/proc/stat"
THREAD_STAT = "/proc/thread-self/stat"
_STEAL = 7  # the aggregate "cpu" line's fields: user nice system idle iowait irq softirq steal ...


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    wall_s: float  # time.perf_counter(), read beside thread_cpu_s
    thread_cpu_s: float
    voluntary_switches: int | None
    involuntary_switches: int | None
    steal_ticks: int | None  # the whole host's, since boot (USER_HZ ticks)
    total_ticks: int | None
    cpu: int | None  # the CPU the calling thread last ran on

    @classmethod
    def take(cls, proc_stat: str = PROC_STAT, thread_stat: str = THREAD_STAT) -> LoadSnapshot:
        voluntary = involuntary = None
        if hasattr(resource, "RUSAGE_THREAD"):  # (Linux)
            usage = resource.getrusage(resource.RUSAGE_THREAD)
            voluntary, involuntary = usage.ru_nvcsw, usage.ru_nivcsw
        steal, total, cpu = *_cpu_ticks(proc_stat), _last_cpu(thread_stat)
        return cls(time.perf_counter(), time.thread_time(), voluntary, involuntary, steal, total, cpu)


def over_run(before: LoadSnapshot, after: LoadSnapshot, num_steps: int) -> dict:
    """The bench record's `host_load`: the step loop thread's CPU ms a step and share of the wall, its context
    switches a step, the host's steal share over the run, and the CPU the thread ran on at each end."""
    steps = max(num_steps, 1)

    def per_step(name: str) -> float | None:
        a, b = getattr(before, name), getattr(after, name)
        return None if a is None or b is None else (b - a) / steps

    cpu_s, wall_s = after.thread_cpu_s - before.thread_cpu_s, after.wall_s - before.wall_s
    steal = None
    if None not in (before.steal_ticks, after.steal_ticks, before.total_ticks, after.total_ticks):
        ticks = after.total_ticks - before.total_ticks
        steal = (after.steal_ticks - before.steal_ticks) / ticks if ticks > 0 else 0.0
    return {"thread_cpu_ms": 1e3 * cpu_s / steps, "thread_cpu_share": cpu_s / wall_s if wall_s > 0 else None,
            "voluntary_switches": per_step("voluntary_switches"),
            "involuntary_switches": per_step("involuntary_switches"),
            "host_steal_share": steal, "cpu_first": before.cpu, "cpu_last": after.cpu}


def _cpu_ticks(proc_stat: str) -> tuple[int | None, int | None]:
    """(steal, all) ticks of /proc/stat's aggregate line; (None, None) where it is missing or short."""
    try:
        with open(proc_stat) as f:
            fields = f.readline().split()
    except OSError:
        return None, None
    if len(fields) <= _STEAL + 1 or fields[0] != "cpu":
        return None, None
    ticks = [int(value) for value in fields[1:]]
    # guest time is already counted in user and nice: the first eight fields are the whole
    return ticks[_STEAL], sum(ticks[:_STEAL + 1])


def _last_cpu(thread_stat: str) -> int | None:
    """Field 39 of /proc/thread-self/stat (the CPU the thread last ran on). The command name, field 2, may hold
    spaces: the fields are counted after its closing parenthesis."""
    try:
        with open(thread_stat) as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2:].split()
    return int(rest[36]) if len(rest) > 36 else None
