"""CollectorPacing: the cyclic garbage collector's thresholds while an engine's step loop runs.

CPython starts a young collection every 700 net allocations of container objects, and a full one once ten
young and ten middle ones have run and a quarter of the heap is new. A step of 256 sequences builds and drops
thousands of small containers; reference counting frees nearly all of them at once, yet they still move the
counter, and every full collection walks every live object: the waiting and running sequences, their token
lists and block tables. On a sharegpt-like job of 1,024 requests (`benchmarks/bench_host_step.py`, this
project's 2-core CPU) the step loop ran 888 young, 81 middle and 7 full collections: 291 ms, 6% of its 4.5 s of
host work, the full ones up to 30 ms each; paced as below, 7 young and 1 middle one, 36 ms. On the GPU the host
schedules a step while the one before runs, so a pause longer than that step idles the device.

While a step loop runs (`paced()`, entered by the job runner, `LLM`, the data-parallel workers, the
tensor-parallel ranks > 0 and the bench), the collector starts a young collection every 10,000 net allocations and
an older one every 10 of the next younger. Nothing becomes uncollectable, unlike `gc.freeze()`, whose objects are
never freed: a long job's finished requests would leak. Garbage in reference cycles is only found later. Loops may
nest (and run on several threads): the outermost one sets the thresholds and restores the caller's own when it
ends.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

STEP_LOOP_THRESHOLDS = (10_000, 10, 10)  # (young, middle, old); CPython's default is (700, 10, 10)


class CollectorPacing:
    """Reference-counted scope over gc.set_threshold: thresholds while at least one loop runs, the saved
    ones (read when the first loop entered) after the last one leaves."""

    def __init__(self, thresholds: tuple[int, int, int] = STEP_LOOP_THRESHOLDS) -> None:
        if len(thresholds) != 3 or min(thresholds) < 1:
            raise ValueError(f"collector thresholds are three positive ints, got {thresholds!r}")
        self.thresholds = tuple(thresholds)
        self._lock = threading.Lock()
        self._depth = 0  # loops inside the scope
        self._saved: tuple[int, ...] | None = None  # the thresholds before the outermost loop

    @contextlib.contextmanager
    def paced(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = gc.get_threshold()
                gc.set_threshold(*self.thresholds)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    gc.set_threshold(*self._saved)


STEP_LOOPS = CollectorPacing()


def paced() -> contextlib.AbstractContextManager[None]:
    """The step loops' collector pacing, for the duration of a `with` block."""
    return STEP_LOOPS.paced()
