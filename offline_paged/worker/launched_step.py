"""LaunchedStep: a step whose device work is queued but whose sampled tokens may not have reached the host.

`ModelRunner.launch` returns one; `wait()` brings the step's results to the host (the step's one
device->host copy). Between the two, the engine schedules and launches the next step: a sequence whose
token from this step is still pending gets it as input on the device, gathered from `sampled_ids`
(one entry per sampling request) at `sample_index[seq_id]`. On the CPU everything is computed at
launch and `wait()` only hands it over.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from offline_paged.core.sequence import SequenceResult
from offline_paged.worker.step_report import DeviceTimer


class ReadySamples:
    """Samples already on the host (the NumPy sampler, or no sampling rows)."""

    __slots__ = ("_results", "token_ids")

    def __init__(self, results: list) -> None:
        self._results = results
        self.token_ids = np.fromiter((r.token_id for r in results), np.int32, len(results))  # [R]

    def results(self) -> list:
        return self._results


class LateSamples:
    """Samples whose sampling is queued only when `launch()` first runs (a structured-output step's masks
    fill on a host thread meanwhile). `results()` launches it, and so does `token_ids` unless the device
    array the sampler will write is known in advance (a decode graph's); the runner launches it before
    the next step's device work that reuses its buffers (`LaunchedStep.queue_sampling`), or the step loop
    right after it processed the previous step when `early` (`LaunchedStep.queue_early_sampling`)."""

    __slots__ = ("_start", "_samples", "_token_ids", "early")

    def __init__(self, start: Callable[[], Any], token_ids=None, early: bool = False) -> None:
        self._start = start  # () -> PendingSamples: waits for the masks, queues the sampling
        self._samples = None
        self._token_ids = token_ids  # [R] int32 (device), written by the sampling once queued
        self.early = early  # its masks come fast (a MaskServer's): queue it before the next step is scheduled

    @property
    def launched(self) -> bool:
        return self._samples is not None

    def launch(self):
        if self._samples is None:
            self._samples = self._start()
        return self._samples

    @property
    def token_ids(self):
        """[R] int32 (device): read it only in work queued after `launch()` (the stream orders them)."""
        return self._token_ids if self._token_ids is not None else self.launch().token_ids

    def results(self) -> list:
        return self.launch().results()


class OneSampleEach(Sequence):
    """A step's results when sequence i drew exactly sample i (the decode graph's samples): each
    SequenceResult is built when it is read and dropped after. A list of S SequenceResults (and S one-sample
    lists) alive next to the S samples pushed CPython's cyclic GC past its allocation threshold every step:
    with 256 sequences that was a young collection each step and a full one (~18 ms) every ~40 steps."""

    __slots__ = ("_samples", "_prompt_logprobs")

    def __init__(self, samples: list, prompt_logprobs: list) -> None:
        self._samples, self._prompt_logprobs = samples, prompt_logprobs

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return SequenceResult([self._samples[index]], self._prompt_logprobs[index])

    def __iter__(self):
        for sample, prompt in zip(self._samples, self._prompt_logprobs):
            yield SequenceResult([sample], prompt)

    def first_samples(self) -> list:
        """Sample i of sequence i, for each (no SequenceResult built)."""
        return self._samples


@dataclass(slots=True)
class ExecuteOutput:
    results: Sequence[SequenceResult]  # one per scheduled sequence, in order
    forward_timer: DeviceTimer | None  # CUDA events around the forward; None on the CPU
    used_cuda_graph: bool
    num_samples: int  # sampled tokens in all results


@dataclass(slots=True, kw_only=True)
class LaunchedStep:
    """A launched step, built by keyword by the runner's paths (ModelRunner.launch)."""

    output: Any  # the SchedulerOutput it runs
    samples: Any  # ReadySamples, gpu_sampler.PendingSamples or LateSamples: token_ids [R] (device) and results()
    # seq id -> index in samples.token_ids of the token it will append; None for a decode graph step's samples,
    # which are found by their rows (sample_rows, sample_seq_ids; the map is built from them when needed).
    sample_index: dict[int, int] | None
    # Per sampling request: index of its scheduled sequence. None when request i is sequence i's only sample
    # (every sequence draws exactly one: the decode graph's own samples).
    owners: list[int] | None
    prompt_logprobs: list  # per scheduled sequence: entries or None (computed at launch)
    forward_timer: DeviceTimer | None  # CUDA events around the forward; None on the CPU or when nothing ran
    used_cuda_graph: bool  # the forward replayed a decode graph
    # (logits, their row offsets, the decode-graph replay whose masked sampler draws them or None) of a step
    # whose sampling waits for ModelRunner.launch_deferred_sampling (structured output under async scheduling);
    # `samples` is None until then.
    deferred_logits: tuple | None = None
    # A decode graph step that drew one token per sequence (masked or not): the block-table row [R] and seq id [R]
    # of sample i's sequence (step_inputs.decode_pending_inputs finds the next decode step's pending tokens by row).
    sample_rows: np.ndarray | None = None
    sample_seq_ids: np.ndarray | None = None
    _done: ExecuteOutput | None = None

    @classmethod
    def nothing_run(cls, output) -> LaunchedStep:
        """A step with no scheduled sequence (only block moves, if any): no forward, no samples."""
        return cls(output=output, samples=ReadySamples([]), sample_index={}, owners=[], prompt_logprobs=[],
                   forward_timer=None, used_cuda_graph=False)

    def queue_sampling(self) -> None:
        """Queue a late sampling (LateSamples) now, if it is not queued yet: before the next step's device
        work, which reuses the decode graph's logits and input buffers."""
        if isinstance(self.samples, LateSamples):
            self.samples.launch()

    def queue_early_sampling(self) -> None:
        """Queue a late sampling now if it asked to be queued early (LateSamples.early): the device then
        samples as soon as the forward ends, while the host schedules the next step."""
        if isinstance(self.samples, LateSamples) and self.samples.early:
            self.samples.launch()

    @property
    def samples_early(self) -> bool:
        """Its late sampling waits for masks and asked to be queued early (`queue_early_sampling`), not yet queued."""
        return isinstance(self.samples, LateSamples) and self.samples.early and not self.samples.launched

    @property
    def sampling_deferred(self) -> bool:
        return self.deferred_logits is not None

    def wait(self) -> ExecuteOutput:
        """The step's results on the host (waits for the device once; later calls return the same)."""
        if self._done is None:
            if self.sampling_deferred:
                raise RuntimeError("this step's sampling was deferred and never launched "
                                   "(ModelRunner.launch_deferred_sampling)")
            samples = self.samples.results()
            if self.owners is None:
                results = OneSampleEach(samples, self.prompt_logprobs)
            else:
                per_seq: list[list] = [[] for _ in self.output.scheduled]
                for owner, sample in zip(self.owners, samples):
                    per_seq[owner].append(sample)
                results = [SequenceResult(samples, prompt) for samples, prompt in zip(per_seq, self.prompt_logprobs)]
            self._done = ExecuteOutput(results, self.forward_timer, self.used_cuda_graph, len(samples))
        return self._done
