"""HostCpus: the CPUs this process may run on, the physical cores under them, and the cgroup's CPU quota.

Where the host paces the steps (structured output's mask workers beside the step loop), what counts is the
cores that run at once. `os.cpu_count()` counts every logical CPU of the machine: both SMT threads of a core
(two threads share one core's execution units), CPUs outside this process's affinity mask (`taskset`, a
container's cpuset) and CPUs beyond a container's quota (`docker --cpus 4` on a 64-CPU machine). Missing facts
(another OS, a sandbox without /sys) are None, and `usable_cores` falls back on what is known.
"""
from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass

SYS_CPU = "/sys/devices/system/cpu"
CPUINFO = "/proc/cpuinfo"
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" in microseconds, or "max PERIOD"


@dataclass(frozen=True, slots=True)
class HostCpus:
    cpus: int  # logical CPUs in this process's affinity mask
    physical_cores: int | None  # distinct SMT sibling sets among them
    cpu_model: str | None
    quota_cpus: float | None  # the cgroup's CPU quota in CPUs (None: no quota)

    @classmethod
    def read(cls, sys_cpu: str = SYS_CPU, cpuinfo: str = CPUINFO, cpu_max: str = CGROUP_CPU_MAX) -> HostCpus:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
        return cls(len(cpus), _physical_cores(cpus, sys_cpu), _cpu_model(cpuinfo), _quota_cpus(cpu_max))

    def usable_cores(self) -> int:
        """The cores that can run at once: physical cores (logical CPUs where /sys does not say), at most the
        quota rounded up, at least 1."""
        cores = self.physical_cores or self.cpus
        if self.quota_cpus is not None:
            cores = min(cores, math.ceil(self.quota_cpus))
        return max(1, cores)

    def record(self) -> dict:
        """The bench record's `host` field."""
        return {"cpus": self.cpus, "physical_cores": self.physical_cores, "cpu_model": self.cpu_model,
                "quota_cpus": self.quota_cpus}


def _physical_cores(cpus: list[int], sys_cpu: str) -> int | None:
    cores: set[str] = set()
    try:
        for cpu in cpus:
            with open(f"{sys_cpu}/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
    except OSError:
        return None
    return len(cores) or None


def _cpu_model(cpuinfo: str) -> str | None:
    try:
        with open(cpuinfo) as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        model = None
    return model or platform.processor() or None


def _quota_cpus(cpu_max: str) -> float | None:
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None
