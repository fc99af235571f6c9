"""Scheduler: picks each iteration's batch (continuous batching + chunked prefill), preempts under memory
pressure, and folds the runner's results back into the sequences.

Data structures: `running` and `swapped` are lists kept sorted by priority (request arrival, then
sample index: FCFS); `waiting` is sorted the same way, so preempted sequences go back in front of
requests that arrived after them. Invariants kept between calls:
- every RUNNING sequence holds device blocks for `num_slots` positions, SWAPPED ones CPU blocks,
  WAITING and FINISHED ones none;
- the sequences scheduled in one step are never preempted in that step.

One schedule() builds, in this order, within `max_num_seqs` and `max_num_batched_tokens`:
1. running sequences that are decoding (their next token), oldest first; a sequence that needs a
   new block and cannot get one preempts the youngest running sequence (possibly itself);
2. running sequences in the middle of a (chunked) prefill, oldest first, filling the token budget;
3. if nothing was preempted: swapped sequences, brought back in FCFS order;
4. if nothing was preempted or is still swapped: waiting sequences admitted FCFS while the block
   manager can allocate their tokens (its watermark keeps room for the running ones to grow);
5. if the step is still empty, idle beams (see below) are parked one by one, youngest first, until
   a swapped or waiting sequence fits.

Beam search: a beam whose row is computed is *idle* until its sibling beams have theirs (they may
be scheduled in later steps, or preempted); it stays RUNNING but is never scheduled. Preempting an
idle beam *parks* it: its blocks are freed, its result is kept, it sits in no queue. When the last
beam's result arrives, the beam step (beam_search.BeamState.step) picks the next beams: each is a
fork of its parent, sharing its blocks if the parent is resident, or WAITING to be recomputed if
the parent was parked; the parents are then released. A beam-search request counts as beam_width
sequences against max_num_seqs while any of its beams runs.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from offline_paged.beam_search import BeamStep
from offline_paged.config import PreemptionMode
from offline_paged.sequence import (
    FinishReason,
    Sequence,
    SequenceGroup,
    SequenceResult,
    SequenceStatus,
)

# Called after a token is appended: returns (reason, stop_reason) when the sequence must stop.
StopChecker = Callable[[Sequence], "tuple[FinishReason, int | str | None] | None"]


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    block_table: list[int]
    num_samples: int  # 0 while the prefill is unfinished, else 1, or the request's n to fork
    prompt_logprobs: int | None  # top-k for this chunk's prompt logprobs; None = not wanted

    @property
    def num_skip_write(self) -> int:
        """Leading positions whose K/V is already cached (recomputed only for prompt logprobs)."""
        return self.seq.num_skip_write


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    num_preempted_recompute: int = 0
    num_preempted_swap: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class _StepPlan:
    """Scratch state of one schedule() call."""

    budget: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    scheduled_ids: set[int] = field(default_factory=set)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_recompute: int = 0
    num_swap: int = 0
    num_parked: int = 0  # idle beams parked to let a queued sequence in (not pressure preemptions)

    @property
    def preempted(self) -> bool:
        return self.num_recompute + self.num_swap > 0


def _by_priority(seq: Sequence) -> tuple[int, int]:
    return seq.priority


class Scheduler:
    """Iteration-level scheduler over a BlockManager (see the module docstring for the policy)."""

    def __init__(
        self,
        block_manager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._next_seq_id = itertools.count()

    # ----------------------------------------------------------------- requests
    def add_group(self, group: SequenceGroup) -> None:
        """Queue a new request as one WAITING sequence (sample 0). Raises ValueError when its
        samples could never run side by side (more than max_num_seqs)."""
        if group.num_samples > self.max_num_seqs:
            raise ValueError(f"the request needs {group.num_samples} parallel samples (n / best_of) "
                             f"but max_num_seqs is {self.max_num_seqs}")
        seq = Sequence(
            seq_id=next(self._next_seq_id), group=group, sample_index=0,
            sampling_seed=group.sample_seeds[0], token_ids=list(group.prompt_token_ids),
            num_prompt_tokens=len(group.prompt_token_ids),
            logprobs=[] if group.num_logprobs is not None else None,
        )
        group.seqs.append(seq)
        _insert(self.waiting, seq)

    def abort_group(self, group: SequenceGroup) -> None:
        """Finish every unfinished sequence of `group` with ABORT and release its blocks."""
        group.forked = True  # an aborted request never forks
        if group.beam is not None:
            group.beam.pending.clear()
        for seq in group.seqs:
            if not seq.is_finished:
                self._release(seq)
                seq.finish(FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished_seqs(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_queued(plan)
        while not plan.scheduled and self._park_youngest_idle_beam():
            plan.num_parked += 1
            self._schedule_queued(plan)
        return SchedulerOutput(
            scheduled=plan.scheduled, blocks_to_swap_out=plan.swap_out,
            blocks_to_swap_in=plan.swap_in, blocks_to_copy=plan.copies,
            num_preempted_recompute=plan.num_recompute + plan.num_parked, num_preempted_swap=plan.num_swap,
        )

    def _schedule_queued(self, plan: _StepPlan) -> None:
        self._schedule_swapped(plan)
        if not self.swapped:
            self._schedule_waiting(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if plan.budget == 0:
                return
            if seq.status is SequenceStatus.RUNNING and self._reserve_slots(seq, plan):
                self._schedule(seq, plan)

    def _reserve_slots(self, seq: Sequence, plan: _StepPlan) -> bool:
        """Reserve KV slots for all of seq's tokens, preempting the youngest running sequences
        until it fits. False if `seq` itself had to be preempted."""
        while not self._try_append(seq, plan):
            victim = self._youngest_victim(seq, plan)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _youngest_victim(self, seq: Sequence, plan: _StepPlan) -> Sequence:
        """The youngest running sequence not yet scheduled in this step, or `seq` itself if it comes
        first: preempting a scheduled one would free blocks its part of the step still writes."""
        for candidate in reversed(self.running):
            if candidate is seq or candidate.seq_id not in plan.scheduled_ids:
                return candidate
        raise RuntimeError(f"sequence {seq.seq_id} is not in the running queue")

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        while self.swapped and plan.budget > 0:
            seq = self.swapped[0]
            if not self._has_room_for(seq) or not self.block_manager.can_swap_in(seq.seq_id):
                return
            self.swapped.pop(0)
            plan.swap_in += self.block_manager.swap_in(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            _insert(self.running, seq)
            if self._try_append(seq, plan):
                self._schedule(seq, plan)

    def _try_append(self, seq: Sequence, plan: _StepPlan) -> bool:
        """Reserve seq's missing slots without preempting anyone; False if they do not fit now."""
        needed = seq.num_tokens - seq.num_slots
        if needed == 0:
            return True
        if not self.block_manager.can_append_slots(seq.seq_id, needed):
            return False
        plan.copies += self.block_manager.append_slots(seq.seq_id, needed)
        seq.num_slots += needed
        return True

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while self.waiting and plan.budget > 0:
            seq = self.waiting[0]
            if not self._has_room_for(seq) or not self.block_manager.can_allocate(seq.token_ids):
                return
            self.waiting.pop(0)
            self._admit(seq)
            self._schedule(seq, plan)

    def _has_room_for(self, seq: Sequence) -> bool:
        """Whether seq (and the samples it will fork into) fit within max_num_seqs."""
        return _num_reserved_seqs([*self.running, seq]) <= self.max_num_seqs

    def _admit(self, seq: Sequence) -> None:
        num_cached = self.block_manager.allocate(seq.seq_id, seq.token_ids)
        if seq.num_output_tokens == 0:
            seq.group.num_cached_tokens = max(seq.group.num_cached_tokens, num_cached)
        seq.num_slots = seq.num_tokens
        if seq.group.wants_prompt_logprobs:
            # Prompt logprobs need logits at every scored position: compute the cached prefix again
            # from the row before the first scored token (params.prompt_logprobs_start), but never
            # write it (the cached blocks may be shared). Unscored positions get None.
            reused = min(num_cached, max(seq.group.params.prompt_logprobs_start - 1, 0))
            seq.num_computed_tokens, seq.num_skip_write = reused, num_cached
            _pad_prompt_logprobs(seq.group, reused + 1)
        else:
            seq.num_computed_tokens, seq.num_skip_write = num_cached, 0
        seq.status = SequenceStatus.RUNNING
        _insert(self.running, seq)

    def _schedule(self, seq: Sequence, plan: _StepPlan) -> None:
        num_new = min(seq.num_uncomputed_tokens, plan.budget)
        plan.budget -= num_new
        done = seq.num_computed_tokens + num_new == seq.num_tokens
        group = seq.group
        plan.scheduled_ids.add(seq.seq_id)
        plan.scheduled.append(ScheduledSequence(
            seq=seq, start=seq.num_computed_tokens, num_new_tokens=num_new,
            block_table=list(self.block_manager.block_table(seq.seq_id)),
            num_samples=(group.num_samples if group.needs_fork else 1) if done else 0,
            prompt_logprobs=group.params.prompt_logprobs if group.wants_prompt_logprobs else None,
        ))
        # Each layer writes the whole batch's K/V before any attention reads it, so the blocks this
        # step fills may be reused by a prompt admitted later in the same step: a batch job's shared
        # system prompt is computed once, not once per request of the first step.
        self.block_manager.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new)

    # ----------------------------------------------------------------- preemption
    def _preempt(self, seq: Sequence, plan: _StepPlan) -> None:
        if _is_idle_beam(seq):
            self._park(seq)
            plan.num_recompute += 1
            return
        self.running.remove(seq)
        if self.preemption_mode is PreemptionMode.SWAP and self.block_manager.can_swap_out(seq.seq_id):
            plan.swap_out += self.block_manager.swap_out(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            _insert(self.swapped, seq)
            plan.num_swap += 1
        else:
            self.block_manager.free(seq.seq_id)
            seq.forget_cache()
            _insert(self.waiting, seq)
            plan.num_recompute += 1

    def _park(self, seq: Sequence) -> None:
        """Drop an idle beam's blocks; its result is kept until its beam step."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.forget_cache()
        seq.status = SequenceStatus.PARKED

    def _park_youngest_idle_beam(self) -> bool:
        if not (self.waiting or self.swapped):
            return False
        for seq in reversed(self.running):
            if _is_idle_beam(seq):
                self._park(seq)
                return True
        return False

    # ----------------------------------------------------------------- postprocess
    def postprocess(
        self, output: SchedulerOutput, results: list[SequenceResult], stop_checker: StopChecker
    ) -> list[SequenceGroup]:
        """Fold one step's results in: advance computed counts, register computed blocks with the
        prefix cache, fork, append sampled tokens, stop and free finished sequences.
        Returns the requests that finished in this step."""
        if len(results) != len(output.scheduled):
            raise RuntimeError(f"runner returned {len(results)} results for {len(output.scheduled)} sequences")
        finished: list[SequenceGroup] = []
        for item, result in zip(output.scheduled, results):
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_new_tokens
            self.block_manager.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if result.prompt_logprobs is not None:
                _extend_prompt_logprobs(seq.group, item.start, result.prompt_logprobs)
            if len(result.samples) != item.num_samples:
                raise RuntimeError(f"sequence {seq.seq_id}: expected {item.num_samples} samples, "
                                   f"got {len(result.samples)}")
            if seq.group.beam is not None:
                if result.samples:
                    self._beam_result(seq, result.samples[0], stop_checker)
            else:
                targets = self._fork(seq, len(result.samples)) if len(result.samples) > 1 else [seq]
                for target, sample in zip(targets, result.samples):
                    self._append(target, sample, stop_checker)
            if seq.group.is_finished and seq.group not in finished:
                finished.append(seq.group)
        return finished

    def _fork(self, parent: Sequence, num_samples: int) -> list[Sequence]:
        group = parent.group
        children = []
        for index in range(1, num_samples):
            child = parent.fork(next(self._next_seq_id), index, group.sample_seeds[index])
            self.block_manager.fork(parent.seq_id, child.seq_id)
            group.seqs.append(child)
            _insert(self.running, child)
            children.append(child)
        group.forked = True
        return [parent, *children]

    def _beam_result(self, seq: Sequence, sample, stop_checker: StopChecker) -> None:
        """Record one beam's row; once every live beam has one, run the beam step."""
        group = seq.group
        group.beam.add_result(seq, sample)
        if group.beam.is_ready(group.seqs):
            self._apply_beam_step(group, group.beam.step(group.seqs, stop_checker, self._new_seq_id))

    def _apply_beam_step(self, group: SequenceGroup, step: BeamStep) -> None:
        """Fork the chosen children off their parents, then retire every parent."""
        for child, parent in step.children:
            if parent.status is SequenceStatus.RUNNING:
                self.block_manager.fork(parent.seq_id, child.seq_id)
                _insert(self.running, child)
            else:  # a parked parent has no blocks to share: the child is recomputed
                child.forget_cache()
                _insert(self.waiting, child)
        for parent in group.seqs:
            self._release(parent)
            parent.status = SequenceStatus.FINISHED
        group.seqs = [child for child, _ in step.children]
        group.forked = True

    def _new_seq_id(self) -> int:
        return next(self._next_seq_id)

    def _append(self, seq: Sequence, sample, stop_checker: StopChecker) -> None:
        seq.append_token(sample)
        stop = stop_checker(seq)
        if stop is not None:
            self._release(seq)
            seq.finish(*stop)

    def _release(self, seq: Sequence) -> None:
        """Remove seq from whichever queue holds it and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)


def _extend_prompt_logprobs(group: SequenceGroup, start: int, entries: list) -> None:
    """entries score prompt positions start+1, ...; a re-prefill after recompute preemption
    scores positions already known again, so only the new ones are kept."""
    skip = len(group.prompt_logprobs) - (start + 1)
    if skip < 0:
        raise RuntimeError(f"prompt logprobs of {group.request_id!r} would skip positions")
    unscored = group.params.prompt_logprobs_start - len(group.prompt_logprobs)  # None whatever the cache held
    group.prompt_logprobs.extend(None if i < unscored else e for i, e in enumerate(entries[skip:]))


def _pad_prompt_logprobs(group: SequenceGroup, length: int) -> None:
    """None for the prompt positions that will not be scored (those before `length`)."""
    group.prompt_logprobs.extend([None] * (length - len(group.prompt_logprobs)))


def _is_idle_beam(seq: Sequence) -> bool:
    return seq.group.beam is not None and seq.group.beam.is_idle(seq)


def _num_reserved_seqs(seqs: list[Sequence]) -> int:
    """Sequences these may occupy: n for a request still to fork, beam_width per beam request."""
    beam_groups = {id(s.group): s.group for s in seqs if s.group.beam is not None}
    others = sum(s.group.num_pending_seqs for s in seqs if s.group.beam is None)
    return others + sum(g.params.beam_width for g in beam_groups.values())


def _insert(queue: list[Sequence], seq: Sequence) -> None:
    bisect.insort(queue, seq, key=_by_priority)
