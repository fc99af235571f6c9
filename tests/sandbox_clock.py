"""Test helper: the template sandbox's CPU clock (models/template_sandbox.py reads `time.thread_time()` at
the start of a render and at every CLOCK_EVERY-th traced call or template line) replaced by a counter that
advances a fixed step per read. A render's work is then counted in clock reads, and its deadline falls after
max_seconds / step reads on any machine, loaded or not."""
from __future__ import annotations


class CountingClock:
    def __init__(self, step: float) -> None:
        self.step = step
        self.reads = 0

    def thread_time(self) -> float:
        self.reads += 1
        return self.reads * self.step

    def reads_to(self, seconds: float) -> int:
        """Reads after which a deadline `seconds` after a read at 0 has passed."""
        return int(seconds / self.step) + 1


def count_sandbox_clock(monkeypatch, step: float) -> CountingClock:
    from offline_paged.models import template_sandbox

    clock = CountingClock(step)
    monkeypatch.setattr(template_sandbox, "time", clock)
    return clock
