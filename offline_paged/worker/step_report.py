"""StepReport: what one engine step did and how long its parts took, reported by the step itself.

Host times come from perf_counter around the engine's three phases. The device time of the forward
comes from two CUDA events the runner records on its stream around the forward (eager or a graph
replay), never inside a captured region; reading it waits for the end event, so it is read lazily.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DeviceTimer:
    """A pair of CUDA events around one forward; `elapsed_s()` waits for the second."""

    __slots__ = ("_xp", "_start", "_end")

    def __init__(self, xp) -> None:
        self._xp = xp
        self._start, self._end = xp.cuda.Event(), xp.cuda.Event()

    def start(self) -> None:
        self._start.record()

    def stop(self) -> None:
        self._end.record()

    def elapsed_s(self) -> float:
        self._end.synchronize()
        return self._xp.cuda.get_elapsed_time(self._start, self._end) / 1e3

    def idle_since_s(self, previous: "DeviceTimer") -> float:
        """Device seconds from the end of `previous` (an earlier step's forward) to the start of this one:
        what the device spent outside the forwards (the samples' download, waiting for the host)."""
        self._start.synchronize()
        return self._xp.cuda.get_elapsed_time(previous._end, self._start) / 1e3


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step: the scheduled sequences, host seconds per phase, and the forward's device timer
    (None on the CPU or when nothing ran)."""

    scheduled: list[Any]  # the step's ScheduledSequences
    schedule_s: float
    execute_s: float
    postprocess_s: float
    forward_timer: DeviceTimer | None
    used_cuda_graph: bool
    # Parts of postprocess_s: waiting for the previous step's samples on the host, and (structured output
    # under async scheduling) feeding its tokens to the matchers and starting this step's mask fill.
    token_wait_s: float = 0.0
    mask_dispatch_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)
