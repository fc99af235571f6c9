"""RequestProgress (entrypoints/progress.py): one bar step per finished request, with token counts,
through a tqdm-like class; no bar at all when use_tqdm is False."""
from __future__ import annotations

import numpy as np

from offline_paged.core.outputs import CompletionOutput, RequestOutput
from offline_paged.entrypoints.progress import RequestProgress


class FakeBar:
    made: list[FakeBar] = []

    def __init__(self, total, desc, dynamic_ncols):
        self.total, self.desc, self.n, self.postfix, self.closed = total, desc, 0, None, False
        FakeBar.made.append(self)

    def set_postfix_str(self, text, refresh):
        self.postfix = text

    def update(self, k):
        self.n += k

    def close(self):
        self.closed = True


def _output(rng, prompt_len: int, output_lens: list[int]) -> RequestOutput:
    outputs = [CompletionOutput(i, "", rng.integers(0, 50, size=n).tolist(), None, None, "length")
               for i, n in enumerate(output_lens)]
    return RequestOutput("r", None, rng.integers(0, 50, size=prompt_len).tolist(), None, outputs, True)


def test_bar_counts_requests_and_shows_speeds():
    rng = np.random.default_rng(9)
    FakeBar.made.clear()
    progress = RequestProgress(3, use_tqdm=FakeBar, desc="d")
    [bar] = FakeBar.made
    assert (bar.total, bar.desc) == (3, "d")
    for prompt_len, outs in [(5, [3, 4]), (2, [1])]:
        progress.update(_output(rng, prompt_len, outs))
    assert bar.n == 2
    assert bar.postfix.startswith("est. speed input: ") and "output: " in bar.postfix
    speeds = [float(part.split(": ")[-1].split()[0]) for part in bar.postfix.split(", ")]
    assert speeds[0] > 0 and abs(speeds[1] / speeds[0] - 8 / 7) < 0.01  # 8 output vs 7 input tokens
    progress.close()
    assert bar.closed


def test_no_bar_when_disabled():
    progress = RequestProgress(2, use_tqdm=False)
    progress.update(_output(np.random.default_rng(1), 3, [2]))
    progress.close()  # nothing to show, nothing fails
