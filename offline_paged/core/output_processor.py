"""OutputProcessor: folds one step's sampled tokens into the sequences (the scheduler only schedules).

For each scheduled sequence, in step order: the scheduler records its computed tokens (prefix-cache
registration included); prompt log-probabilities are appended; then either the beam step runs (once
every live beam of the request has its row) or the sampled tokens are appended, forking the request
into its n samples on the first one, and the stop checker decides whether each sample is done.
Finished sequences give their blocks back through the scheduler at once.
"""
from __future__ import annotations

from collections.abc import Callable

from offline_paged.core.beam_search import BeamStep
from offline_paged.core.scheduler import Scheduler, SchedulerOutput
from offline_paged.core.sequence import FinishReason, Sequence, SequenceGroup, SequenceResult, SequenceStatus

# Called after a token is appended: returns (reason, stop_reason) when the sequence must stop.
StopChecker = Callable[[Sequence], "tuple[FinishReason, int | str | None] | None"]


class OutputProcessor:
    """Consumes a step's results; holds no state of its own between steps."""

    def __init__(self, scheduler: Scheduler, stop_checker: StopChecker) -> None:
        self.scheduler = scheduler
        self.stop_checker = stop_checker
        # core.stop_checker.StopChecker takes `pending` and has `settle`: grammar outcomes a mask server is
        # still computing are applied after the step's other sequences (their wait hides behind them).
        self._settle = getattr(stop_checker, "settle", None)

    def process(self, output: SchedulerOutput, results: list[SequenceResult]) -> list[SequenceGroup]:
        """Fold one step's results in; returns the requests that finished in this step.

        Raises RuntimeError when the results do not match the step (a runner bug)."""
        if len(results) != len(output.scheduled):
            raise RuntimeError(f"runner returned {len(results)} results for {len(output.scheduled)} sequences")
        finished: list[SequenceGroup] = []
        pending: list[Sequence] | None = [] if self._settle is not None else None
        for item, result in zip(output.scheduled, results):
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:
                continue  # finished (or aborted) while this lookahead step ran: its token is dropped
            self.scheduler.record_computed(item)
            group, samples = seq.group, result.samples
            if result.prompt_logprobs is not None:
                _extend_prompt_logprobs(group, item.start, result.prompt_logprobs)
            if len(samples) != item.num_samples:
                raise RuntimeError(f"sequence {seq.seq_id}: expected {item.num_samples} samples, "
                                   f"got {len(samples)}")
            if group.beam is not None:
                if samples:
                    self._beam_result(seq, samples[0])
            elif len(samples) == 1:
                self._append(seq, samples[0], pending)
            elif samples:
                for target, sample in zip(self._fork(seq, len(samples)), samples):
                    self._append(target, sample, pending)
            # A group is finished when every sequence in group.seqs is, and an unfinished sequence is always
            # among them (beam parents leave it retired, i.e. FINISHED): while seq runs, skip the group walk.
            if seq.status is SequenceStatus.FINISHED and group.is_finished and group not in finished:
                finished.append(group)
        if pending:
            for seq, stop in self._settle(pending):
                if seq.status is SequenceStatus.FINISHED:
                    seq.finish(*stop)  # a refused token overrides the reason found before its outcome was in
                else:
                    self.scheduler.finish_seq(seq, *stop)
                if seq.group.is_finished and seq.group not in finished:
                    finished.append(seq.group)
        return finished

    def _append(self, seq: Sequence, sample, pending: list[Sequence] | None = None) -> None:
        seq.append_token(sample)
        stop = self.stop_checker(seq) if pending is None else self.stop_checker(seq, pending)
        if stop is not None:
            self.scheduler.finish_seq(seq, *stop)

    def _fork(self, parent: Sequence, num_samples: int) -> list[Sequence]:
        group = parent.group
        children = []
        for index in range(1, num_samples):
            child = parent.fork(self.scheduler.new_seq_id(), index, group.sample_seeds[index])
            group.seqs.append(child)
            self.scheduler.add_fork(parent, child)
            children.append(child)
        group.forked = True
        return [parent, *children]

    def _beam_result(self, seq: Sequence, sample) -> None:
        """Record one beam's row; once every live beam has one, run the beam step."""
        group = seq.group
        group.beam.add_result(seq, sample)
        if group.beam.is_ready(group.seqs):
            step = group.beam.step(group.seqs, self.stop_checker, self.scheduler.new_seq_id)
            self._apply_beam_step(group, step)

    def _apply_beam_step(self, group: SequenceGroup, step: BeamStep) -> None:
        """Fork the chosen children off their parents, then retire every parent."""
        for child, parent in step.children:
            self.scheduler.add_fork(parent, child)
        for parent in group.seqs:
            self.scheduler.retire(parent)
        group.seqs = [child for child, _ in step.children]
        group.forked = True


def _extend_prompt_logprobs(group: SequenceGroup, start: int, entries: list) -> None:
    """entries score prompt positions start+1, ...; a re-prefill after recompute preemption
    scores positions already known again, so only the new ones are kept."""
    skip = len(group.prompt_logprobs) - (start + 1)
    if skip < 0:
        raise RuntimeError(f"prompt logprobs of {group.request_id!r} would skip positions")
    unscored = group.params.prompt_logprobs_start - len(group.prompt_logprobs)  # None whatever the cache held
    group.prompt_logprobs.extend(None if i < unscored else e for i, e in enumerate(entries[skip:]))
