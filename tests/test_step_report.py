"""StepReport and DeviceTimer (worker/step_report.py): the token count of a step, and the timer's event
protocol (record start, record stop, wait for the stop event, milliseconds -> seconds). The CUDA events
are faked; test_bench.py reads real reports from an engine on the CPU."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from offline_paged.worker.step_report import DeviceTimer, StepReport


def _report(scheduled, timer=None) -> StepReport:
    return StepReport(scheduled=scheduled, schedule_s=0.001, execute_s=0.002, postprocess_s=0.0005,
                      forward_timer=timer, used_cuda_graph=False)


def test_num_tokens_sums_the_scheduled_new_tokens():
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 50, size=7).tolist()
    report = _report([types.SimpleNamespace(num_new_tokens=n) for n in counts])
    assert report.num_tokens == sum(counts)
    assert _report([]).num_tokens == 0


def test_report_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _report([]).execute_s = 1.0


class _FakeCuda:
    """cupy.cuda's Event and get_elapsed_time, recording the order of calls."""

    def __init__(self, elapsed_ms: float):
        self.calls: list[str] = []
        self.elapsed_ms = elapsed_ms
        fake = self

        class Event:
            def __init__(self):
                self.name = f"event{sum(c == 'new' for c in fake.calls)}"
                fake.calls.append("new")

            def record(self):
                fake.calls.append(f"record {self.name}")

            def synchronize(self):
                fake.calls.append(f"synchronize {self.name}")

        self.Event = Event

    def get_elapsed_time(self, start, end):
        self.calls.append(f"elapsed {start.name} {end.name}")
        return self.elapsed_ms


def test_device_timer_waits_for_the_stop_event_and_returns_seconds():
    cuda = _FakeCuda(elapsed_ms=float(np.random.default_rng(1).uniform(1, 100)))
    timer = DeviceTimer(types.SimpleNamespace(cuda=cuda))
    timer.start()
    timer.stop()
    assert timer.elapsed_s() == pytest.approx(cuda.elapsed_ms / 1e3, rel=1e-12)
    assert cuda.calls == ["new", "new", "record event0", "record event1", "synchronize event1",
                          "elapsed event0 event1"]
