"""Scheduler: picks each iteration's batch (continuous batching + chunked prefill) and preempts under
memory pressure. It only schedules: the OutputProcessor (output_processor.py) folds a step's sampled
tokens back in through the small seam at the end of the class (record_computed, finish_seq, add_fork,
retire).

Data structures: `waiting`, `running` and `swapped` are SeqQueues kept in priority order (request
arrival, then sample index: FCFS), so preempted sequences go back in front of requests that arrived
after them. A step's ScheduledSequence holds the block manager's own block table list (no copy): it
is read by the runner before anything changes it. Invariants kept between calls:
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

import itertools
from dataclasses import dataclass, field

from offline_paged.core.config import PreemptionMode, require_positive
from offline_paged.core.seq_queue import SeqQueue
from offline_paged.core.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [start, start + num_new_tokens). Read-only once built.

    Not frozen on purpose: a frozen dataclass's __init__ sets every field through object.__setattr__,
    about 4x the cost of a plain one, and a step builds one of these per running sequence."""

    seq: Sequence
    start: int
    num_new_tokens: int
    block_table: list[int]
    num_samples: int  # 0 while the prefill is unfinished, else 1, or the request's n to fork
    prompt_logprobs: int | None  # top-k for this chunk's prompt logprobs; None = not wanted
    sample_position: int  # output position of the token(s) sampled from this row
    # Positions below this had known tokens when the step was scheduled, and their full blocks were offered
    # to the prefix cache then; the rest (a pending input token) are offered by record_computed. 0: none were.
    registered_end: int = 0

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
    # Sequences whose device block tables ended since the last schedule() (finished, aborted,
    # preempted, swapped out, parked): the runner drops the rows it kept for them.
    freed_seq_ids: list[int] = field(default_factory=list)
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


# Most consecutive steps waiting sequences are held back to be admitted in a batch (admission_batch).
MAX_ADMISSION_DEFERRAL = 64


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
        max_model_len: int | None = None,
        admission_batch: int = 1,
    ) -> None:
        """max_model_len: a sequence whose pending token will end it by length (async scheduling)
        is not scheduled again; None = no length limit beyond max_tokens.
        admission_batch: while every running sequence is decoding, waiting ones are admitted only once
        at least this many fit beside them (or all that wait, or after MAX_ADMISSION_DEFERRAL steps).
        A step that prefills beside the decodes costs several decode-only steps (on CUDA it cannot
        replay a decode graph), so admitting sequences in batches as the running ones finish, instead
        of one per finish, runs far fewer such steps. 1: admit whenever one fits (vLLM's policy)."""
        require_positive("admission_batch", admission_batch)
        self.admission_batch = admission_batch
        self._deferred_steps = 0  # consecutive schedule() calls that held waiting sequences back
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting = SeqQueue()
        self.running = SeqQueue()
        self.swapped = SeqQueue()
        self._next_seq_id = itertools.count()
        self._freed_seq_ids: list[int] = []

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
        self.waiting.insert(seq)

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
            freed_seq_ids=self._take_freed_seq_ids(),
            num_preempted_recompute=plan.num_recompute + plan.num_parked, num_preempted_swap=plan.num_swap,
        )

    def _take_freed_seq_ids(self) -> list[int]:
        freed, self._freed_seq_ids = self._freed_seq_ids, []
        return freed

    def _schedule_queued(self, plan: _StepPlan) -> None:
        self._schedule_swapped(plan)
        if not self.swapped:
            self._schedule_waiting(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        decoding, prefilling = [], []
        for seq in self.running:  # (Sequence.num_uncomputed_tokens inline: this runs for every sequence every step)
            num_uncomputed = len(seq.token_ids) + seq.num_pending_tokens - seq.num_computed_tokens
            if num_uncomputed == 1:
                decoding.append(seq)
            elif num_uncomputed > 1:
                prefilling.append(seq)
        for seq in itertools.chain(decoding, prefilling):
            if plan.budget == 0:
                return
            if seq.num_pending_tokens and self._ends_with_pending_token(seq):
                continue  # its last token is on the device: nothing more to compute
            if seq.status is SequenceStatus.RUNNING and self._reserve_slots(seq, plan):
                self._schedule(seq, plan)

    def _ends_with_pending_token(self, seq: Sequence) -> bool:
        """Whether the token still pending will make seq stop by length (max_tokens, max_model_len)."""
        num_tokens = len(seq.token_ids) + seq.num_pending_tokens  # seq.num_tokens
        return (num_tokens - seq.num_prompt_tokens >= seq.group.params.max_tokens  # num_output_tokens
                or (self.max_model_len is not None and num_tokens >= self.max_model_len))

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
        for candidate in self.running.youngest_first():
            if candidate is seq or candidate.seq_id not in plan.scheduled_ids:
                return candidate
        raise RuntimeError(f"sequence {seq.seq_id} is not in the running queue")

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        if not self.swapped:
            return  # the usual case: skip counting the running queue's occupancy (O(running))
        occupancy = _Occupancy(self.running)
        while self.swapped and plan.budget > 0:
            seq = self.swapped.head()
            if seq.num_pending_tokens:
                return  # preempted with a token in flight: readmitted once it is known
            if not occupancy.has_room_for(seq, self.max_num_seqs) or not self.block_manager.can_swap_in(seq.seq_id):
                return
            self.swapped.pop_head()
            occupancy.add(seq)
            plan.swap_in += self.block_manager.swap_in(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            self.running.insert(seq)
            if self._try_append(seq, plan):
                self._schedule(seq, plan)

    def _try_append(self, seq: Sequence, plan: _StepPlan) -> bool:
        """Reserve seq's missing slots without preempting anyone; False if they do not fit now."""
        needed = len(seq.token_ids) + seq.num_pending_tokens - seq.num_slots  # seq.num_tokens - seq.num_slots
        if needed == 0:
            return True
        copies = self.block_manager.try_append_slots(seq.seq_id, needed)
        if copies is None:
            return False
        if copies:
            plan.copies += copies
        seq.num_slots += needed
        return True

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        if not self.waiting:
            return  # as in _schedule_swapped: no occupancy count when nothing waits
        occupancy = _Occupancy(self.running)
        if not self._admission_due(plan, occupancy):
            return
        while self.waiting and plan.budget > 0:
            seq = self.waiting.head()
            if seq.num_pending_tokens:
                return  # preempted with a token in flight: readmitted once it is known
            if not occupancy.has_room_for(seq, self.max_num_seqs) or not self.block_manager.can_allocate(seq.token_ids):
                return
            self.waiting.pop_head()
            occupancy.add(seq)
            self._admit(seq)
            self._schedule(seq, plan)

    def _admission_due(self, plan: _StepPlan, occupancy: "_Occupancy") -> bool:
        """Whether waiting sequences may be admitted this step (see admission_batch): yes when the step
        already prefills (admitting costs no extra mixed step), when nothing runs, when a batch of them
        fits, or when they have been held back for MAX_ADMISSION_DEFERRAL steps in a row."""
        free = self.max_num_seqs - occupancy.count
        due = (self.admission_batch == 1 or not self.running or not plan.scheduled
               or free >= min(self.admission_batch, len(self.waiting))
               or any(item.num_new_tokens > 1 for item in plan.scheduled)
               or self._deferred_steps >= MAX_ADMISSION_DEFERRAL)
        self._deferred_steps = 0 if due else self._deferred_steps + 1
        return due

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
        self.running.insert(seq)

    def _schedule(self, seq: Sequence, plan: _StepPlan) -> None:
        # (Sequence / SequenceGroup properties read inline where cheap: this runs for every sequence every step.)
        start, num_known = seq.num_computed_tokens, len(seq.token_ids)
        num_tokens = num_known + seq.num_pending_tokens  # seq.num_tokens
        num_new = min(num_tokens - start, plan.budget)
        plan.budget -= num_new
        end = start + num_new
        group = seq.group
        num_samples = 0  # the prefill is unfinished
        if end == num_tokens:
            num_samples = group.num_samples if group.needs_fork else 1
        prompt_logprobs = None
        if group.prompt_logprobs is not None and group.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1:
            prompt_logprobs = group.params.prompt_logprobs
        plan.scheduled_ids.add(seq.seq_id)
        registered_end = min(end, num_known)  # positions whose tokens are known
        plan.scheduled.append(ScheduledSequence(  # positional: a keyword call costs twice as much here
            seq, start, num_new, self.block_manager.block_table(seq.seq_id), num_samples, prompt_logprobs,
            num_tokens - seq.num_prompt_tokens, registered_end,  # sample_position (= num_output_tokens)
        ))
        seq.num_computed_tokens = end  # computed by this step (or the KV is in flight)
        if num_samples and group.beam is None:
            seq.num_pending_tokens += 1  # a beam's token goes to its children, never to itself
        # Each layer writes the whole batch's K/V before any attention reads it, so the blocks this
        # step fills may be reused by a prompt admitted later in the same step: a batch job's shared
        # system prompt is computed once, not once per request of the first step. Blocks holding a
        # pending token are registered when the token is known (record_computed).
        self.block_manager.mark_computed(seq.seq_id, seq.token_ids, registered_end)

    # ----------------------------------------------------------------- preemption
    def _preempt(self, seq: Sequence, plan: _StepPlan) -> None:
        if _is_idle_beam(seq):
            self._park(seq)
            plan.num_recompute += 1
            return
        self.running.remove(seq)
        self._freed_seq_ids.append(seq.seq_id)
        if self.preemption_mode is PreemptionMode.SWAP and self.block_manager.can_swap_out(seq.seq_id):
            plan.swap_out += self.block_manager.swap_out(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.insert(seq)
            plan.num_swap += 1
        else:
            self.block_manager.free(seq.seq_id)
            seq.forget_cache()
            self.waiting.insert(seq)
            plan.num_recompute += 1

    def _park(self, seq: Sequence) -> None:
        """Drop an idle beam's blocks; its result is kept until its beam step."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        self._freed_seq_ids.append(seq.seq_id)
        seq.forget_cache()
        seq.status = SequenceStatus.PARKED

    def _park_youngest_idle_beam(self) -> bool:
        if not (self.waiting or self.swapped):
            return False
        for seq in self.running.youngest_first():
            if _is_idle_beam(seq):
                self._park(seq)
                return True
        return False

    # ----------------------------------------------------------------- the output processor's seam
    def record_computed(self, item: ScheduledSequence) -> None:
        """The step computed item's positions: register the full blocks whose tokens are now known with
        the prefix cache. Nothing to do for a sequence preempted or swapped out since that step was
        scheduled (async scheduling).

        _schedule registered the blocks below item.registered_end already, and a sequence's registration
        only starts over after it leaves RUNNING (swap-out, free), which makes it skip here; so only a
        block ending in (registered_end, end] can be new. Usually there is none: a synchronous step
        knew all its tokens (registered_end = end), and an async decode step starts on its pending token
        (registered_end = start), so a block ends there once every block_size steps."""
        end = item.start + item.num_new_tokens
        if end // self.block_manager.block_size == item.registered_end // self.block_manager.block_size:
            return
        seq = item.seq
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.mark_computed(seq.seq_id, seq.token_ids, min(end, len(seq.token_ids)))

    def finish_seq(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """seq is done: its blocks go back at once."""
        self._release(seq)
        seq.finish(reason, stop_reason)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """Queue `child`, forked from `parent`: it shares the parent's blocks copy-on-write when the
        parent holds them, or waits to be recomputed when the parent was parked (beam search)."""
        if parent.status is SequenceStatus.RUNNING:
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.running.insert(child)
        else:
            child.forget_cache()
            self.waiting.insert(child)

    def retire(self, seq: Sequence) -> None:
        """A beam parent replaced by its children: release it without a finish reason."""
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def new_seq_id(self) -> int:
        return next(self._next_seq_id)

    def _release(self, seq: Sequence) -> None:
        """Remove seq from whichever queue holds it and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
            self._freed_seq_ids.append(seq.seq_id)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)


def _pad_prompt_logprobs(group: SequenceGroup, length: int) -> None:
    """None for the prompt positions that will not be scored (those before `length`)."""
    group.prompt_logprobs.extend([None] * (length - len(group.prompt_logprobs)))


def _is_idle_beam(seq: Sequence) -> bool:
    return seq.group.beam is not None and seq.group.beam.is_idle(seq)


class _Occupancy:
    """Sequences the running queue may occupy (n for a request still to fork, beam_width per beam
    request), counted once per schedule() pass and updated as sequences are admitted."""

    def __init__(self, running: SeqQueue) -> None:
        self.count = 0
        self._beam_groups: set[int] = set()
        # (add() inline for the common sequence: this walks the running queue every step while requests wait)
        for seq in running:
            group = seq.group
            if group.beam is None:
                self.count += group.num_pending_seqs
            else:
                self.add(seq)

    def cost(self, seq: Sequence) -> int:
        group = seq.group
        if group.beam is None:
            return group.num_pending_seqs
        return 0 if id(group) in self._beam_groups else group.params.beam_width

    def add(self, seq: Sequence) -> None:
        self.count += self.cost(seq)
        if seq.group.beam is not None:
            self._beam_groups.add(id(seq.group))

    def has_room_for(self, seq: Sequence, max_num_seqs: int) -> bool:
        return self.count + self.cost(seq) <= max_num_seqs
