"""Scheduler + real BlockManager driven by Hypothesis against a plain-Python model of generation.

The fake runner keeps a simulated KV pool (one token id per slot, device and CPU) and executes the
step's swaps and copies exactly like ModelRunner. Before "computing" a chunk it checks that every
earlier position of the sequence reads back the right token through the block table, so a lost
copy-on-write, a wrong swap, a bad prefix-cache hit or a preemption that forgets what was computed
shows up as wrong context. The next token is a pure function of (context, sample seed), so the
finished outputs must equal the model's whatever the scheduling, pool size or preemption mode.
"""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offline_paged.core.block_manager import BlockManager
from offline_paged.core.config import PreemptionMode
from offline_paged.core.output_processor import OutputProcessor
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.scheduler import Scheduler
from offline_paged.core.sequence import FinishReason, SequenceGroup, SequenceResult, SequenceStatus, TokenSample
from offline_paged.engine import _needs_host_tokens
from offline_paged.worker.block_table_rows import BlockTableRows

EOS = 1
VOCAB = 12  # small, so prompts share prefixes and EOS comes up


def next_token(context: list[int], seed: int) -> int:
    h = seed * 1_000_003
    for t in context:
        h = (h * 31 + t) % 1_000_000_007
    return h % VOCAB


def reference_output(prompt: list[int], seed: int, params: SamplingParams) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(tokens, seed)
        tokens.append(t)
        out.append(t)
        if (t == EOS and len(out) >= params.min_tokens) or len(out) >= params.max_tokens:
            return out


def stop_checker(seq):
    """Like the engine's StopChecker: known tokens only (a lookahead step's token may be pending)."""
    if seq.token_ids[-1] == EOS and seq.num_known_output_tokens >= seq.group.params.min_tokens:
        return FinishReason.STOP, EOS
    if seq.num_known_output_tokens >= seq.group.params.max_tokens:
        return FinishReason.LENGTH, None
    return None


class FakeRunner:
    """Simulated KV pools: slot -> token id (None = never written)."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, scheduler_running) -> None:
        self.block_size = block_size
        self.rows = BlockTableRows(block_size, max_blocks=2, num_rows=2)  # tiny: growth is exercised
        self.scheduler_running = scheduler_running
        self.gpu = [None] * (num_gpu_blocks * block_size)
        self.cpu = [None] * (num_cpu_blocks * block_size)
        self.sampled: dict[int, int] = {}  # seq id -> its token from the last step (the device's copy)

    def _move(self, src_pool, dst_pool, pairs) -> None:
        b = self.block_size
        blocks = [src_pool[s * b:(s + 1) * b] for s, _ in pairs]  # all reads before writes
        for (_, dst), data in zip(pairs, blocks):
            dst_pool[dst * b:(dst + 1) * b] = data

    def execute(self, output) -> list[SequenceResult]:
        self._check_table_rows(output)
        self._move(self.gpu, self.cpu, output.blocks_to_swap_out)
        self._move(self.cpu, self.gpu, output.blocks_to_swap_in)
        self._move(self.gpu, self.gpu, output.blocks_to_copy)
        # Like the model: every layer writes the whole batch's K/V before any attention reads it.
        for item in output.scheduled:
            self._write(item)
        results = [self._run(item) for item in output.scheduled]
        for item, result in zip(output.scheduled, results):
            if result.samples:
                self.sampled[item.seq.seq_id] = result.samples[0].token_id
        return results

    def _tokens(self, seq) -> list[int]:
        """seq's tokens as the device sees them: the known ones, then a pending one from the last step."""
        return seq.token_ids + ([self.sampled[seq.seq_id]] if seq.num_pending_tokens > 1 else [])

    def _check_table_rows(self, output) -> None:
        """The runner's persistent block-table rows, kept by diffs, equal every scheduled table."""
        self.rows.release(output.freed_seq_ids)
        rows = self.rows.sync(output.scheduled)
        for item, row in zip(output.scheduled, rows.tolist()):
            n = len(item.block_table)
            assert self.rows.tables[row, :n].tolist() == item.block_table, "stale block-table row"
            assert not self.rows.tables[row, n:].any(), "block-table row not zero-padded"
        assert self.rows.num_rows_used <= len(self.scheduler_running()), "rows of freed sequences kept"

    def _slot(self, table, pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _write(self, item) -> None:
        for pos in range(max(item.start, item.num_skip_write), item.start + item.num_new_tokens):
            self.gpu[self._slot(item.block_table, pos)] = self._tokens(item.seq)[pos]

    def _run(self, item) -> SequenceResult:
        seq, table = item.seq, item.block_table
        end = item.start + item.num_new_tokens
        context = [self.gpu[self._slot(table, p)] for p in range(end)]
        assert context == self._tokens(seq)[:end], f"seq {seq.seq_id}: KV cache lost its context"
        seeds = seq.group.sample_seeds if item.num_samples > 1 else [seq.sampling_seed]
        samples = [TokenSample(next_token(context, s), -1.0) for s in seeds[:item.num_samples]]
        return SequenceResult(samples)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler = None

    @precondition(lambda self: self.scheduler is None)
    @rule(num_gpu_blocks=st.integers(8, 40), block_size=st.sampled_from([2, 4]),
          max_num_seqs=st.integers(1, 6), max_tokens_budget=st.integers(4, 24),
          swap=st.booleans(), prefix_caching=st.booleans(), lookahead=st.booleans(),
          admission_batch=st.integers(1, 4))
    def setup(self, num_gpu_blocks, block_size, max_num_seqs, max_tokens_budget, swap, prefix_caching,
              lookahead, admission_batch):
        self.lookahead = lookahead  # async scheduling: a step is processed after the next is scheduled
        self.in_flight = None
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        manager = BlockManager(num_gpu_blocks, num_gpu_blocks, block_size, watermark=0.05,
                               enable_prefix_caching=prefix_caching)
        mode = PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE
        self.scheduler = Scheduler(manager, max_num_seqs, max_tokens_budget, mode,
                                   admission_batch=admission_batch)
        self.runner = FakeRunner(num_gpu_blocks, num_gpu_blocks, block_size, lambda: self.scheduler.running)
        self.processor = OutputProcessor(self.scheduler, stop_checker)
        self.groups: dict[str, SequenceGroup] = {}
        self.expected: dict[str, list[list[int]]] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.num_preempted = 0
        self.recorded_end: dict[int, int] = {}  # seq id -> end of its last processed chunk since it was resident

    @precondition(lambda self: self.scheduler is not None)
    @rule(prompt=st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=14),
          shared_prefix=st.booleans(), n=st.integers(1, 3), max_tokens=st.integers(1, 10),
          min_tokens=st.integers(0, 2), seed=st.integers(0, 3))
    def add_request(self, prompt, shared_prefix, n, max_tokens, min_tokens, seed):
        if shared_prefix:
            prompt = [3, 4, 5, 6, 7, 8, 9, 2][:2 * self.block_size] + prompt
        capacity = (self.num_gpu_blocks - int(0.05 * self.num_gpu_blocks)) * self.block_size
        max_tokens = min(max_tokens, capacity - len(prompt))
        if max_tokens < 1:
            return
        n = min(n, self.scheduler.max_num_seqs)
        params = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens))
        request_id = f"r{len(self.groups)}"
        seeds = [seed * 10 + i for i in range(n)]
        group = SequenceGroup(request_id, len(self.groups), None, prompt, params, seeds)
        self.groups[request_id] = group
        self.expected[request_id] = [reference_output(prompt, s, params) for s in seeds]
        self.scheduler.add_group(group)

    @precondition(lambda self: self.scheduler is not None
                  and (self.scheduler.has_unfinished() or self.in_flight is not None))
    @rule()
    def step(self):
        s = self.scheduler
        output = s.schedule()
        assert not output.is_empty or self.in_flight, "nothing scheduled while requests wait: the scheduler stalled"
        assert output.num_batched_tokens <= s.max_num_batched_tokens
        assert all(item.seq.status is SequenceStatus.RUNNING for item in output.scheduled), \
            "a sequence scheduled in this step was preempted in it"
        assert len({item.seq.seq_id for item in output.scheduled}) == len(output.scheduled)
        self.num_preempted += output.num_preempted_recompute + output.num_preempted_swap
        for seq_id in output.freed_seq_ids:  # blocks gone: a sequence's registration starts over
            self.recorded_end.pop(seq_id, None)
        results = self.runner.execute(output)
        if self.in_flight is not None:
            self._process(*self.in_flight)
            self.in_flight = None
        if self.lookahead and output.scheduled and not _needs_host_tokens(output):
            self.in_flight = (output, results)
        else:
            self._process(output, results)

    def _process(self, output, results) -> None:
        for item in output.scheduled:
            if item.seq.status is SequenceStatus.RUNNING:  # still resident: its chunk is recorded now
                end = item.start + item.num_new_tokens
                self.recorded_end[item.seq.seq_id] = max(self.recorded_end.get(item.seq.seq_id, 0), end)
        for group in self.processor.process(output, results):
            self.finished.add(group.request_id)
            got = sorted(seq.output_token_ids for seq in group.seqs)
            assert got == sorted(self.expected[group.request_id]), f"{group.request_id}: wrong tokens"

    @precondition(lambda self: self.scheduler is not None and self.groups)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.groups)))
        group = self.groups[request_id]
        if request_id in self.finished or request_id in self.aborted:
            return
        self.scheduler.abort_group(group)
        self.aborted.add(request_id)

    @invariant()
    def queues_match_statuses(self):
        if self.scheduler is None:
            return
        s = self.scheduler
        for queue, status in ((s.waiting, SequenceStatus.WAITING), (s.running, SequenceStatus.RUNNING),
                              (s.swapped, SequenceStatus.SWAPPED)):
            assert all(seq.status is status for seq in queue)
            keys = [seq.priority for seq in queue]
            assert keys == sorted(keys), "queue not in FCFS order"
        ids = [seq.seq_id for q in (s.waiting, s.running, s.swapped) for seq in q]
        assert len(ids) == len(set(ids)), "a sequence sits in two queues"

    @invariant()
    def block_holders_are_exactly_running_and_swapped(self):
        if self.scheduler is None:
            return
        s = self.scheduler
        holders = {seq.seq_id for q in (s.running, s.swapped) for seq in q}
        assert s.block_manager.num_seqs == len(holders)
        assert all(seq.seq_id in s.block_manager for q in (s.running, s.swapped) for seq in q)

    @invariant()
    def prefix_cache_holds_exactly_the_processed_known_blocks(self):
        """Every full block of a processed chunk is in the prefix cache (for a later prompt to hit), and no
        block is there before its K/V is computed and its tokens are known."""
        if self.scheduler is None or not self.scheduler.block_manager.enable_prefix_caching:
            return
        manager = self.scheduler.block_manager
        for seq in self.scheduler.running:
            registered = manager.num_registered_blocks(seq.seq_id)
            assert registered >= self.recorded_end.get(seq.seq_id, 0) // self.block_size, \
                f"seq {seq.seq_id}: a processed step's full block is missing from the prefix cache"
            assert registered <= min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size, \
                f"seq {seq.seq_id}: a block was cached before it was computed and known"

    @invariant()
    def running_within_limits(self):
        if self.scheduler is None:
            return
        s = self.scheduler
        assert len(s.running) <= s.max_num_seqs
        for seq in s.running:
            assert seq.num_computed_tokens <= seq.num_slots <= seq.num_tokens
            assert s.block_manager.num_slots(seq.seq_id) == seq.num_slots

    def teardown(self):
        if self.scheduler is None:
            return
        for _ in range(10_000):  # drain: every request must finish with the model's tokens
            if not self.scheduler.has_unfinished() and self.in_flight is None:
                break
            self.step()
        assert not self.scheduler.has_unfinished()
        assert self.finished | self.aborted == set(self.groups)
        assert self.scheduler.block_manager.num_seqs == 0


# 150 runs of 40 steps under the ci profile; the fuzz profile (conftest) scales both
SchedulerMachine.TestCase.settings = settings(max_examples=3 * settings.default.max_examples // 2,
                                    stateful_step_count=40 * settings.default.stateful_step_count // 500,
                                    deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_a_lookahead_steps_pending_token_fills_its_block_when_the_step_is_processed():
    """Async scheduling: a decode step scheduled on a pending input token cannot offer that token's block to
    the prefix cache when it is scheduled; record_computed must, when the step is processed, even if the
    sequence is not scheduled again first (the state machine's next schedule() would cover the gap)."""
    manager = BlockManager(8, 8, block_size=4, watermark=0.0, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=16)
    processor = OutputProcessor(scheduler, stop_checker)
    params = SamplingParams(max_tokens=5)
    group = SequenceGroup("r0", 0, None, [3, 4, 5], params, [0])
    scheduler.add_group(group)
    seq = group.seqs[0]
    prefill = scheduler.schedule()  # positions 0..2, samples the token at position 3
    decode = scheduler.schedule()  # position 3, its input still pending
    assert [item.num_new_tokens for item in prefill.scheduled + decode.scheduled] == [3, 1]
    for output, token in ((prefill, 6), (decode, 7)):
        processor.process(output, [SequenceResult([TokenSample(token, -0.5)])])
    assert seq.token_ids == [3, 4, 5, 6, 7] and seq.status is SequenceStatus.RUNNING
    assert manager.num_registered_blocks(seq.seq_id) == 1, "block 0 (positions 0..3) is computed and known"


# ------------------------------------------------------------------------------ admission in batches
def _decoding_scheduler(admission_batch: int, num_running: int = 4, num_waiting: int = 3, max_num_seqs: int = 4,
                        running_max_tokens=lambda i: 2 + i):
    """A scheduler whose `num_running` sequences have been prefilled and now decode, with `num_waiting`
    more queued behind them (max_num_seqs full)."""
    manager = BlockManager(64, 0, block_size=4, watermark=0.0, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                          admission_batch=admission_batch)
    processor = OutputProcessor(scheduler, stop_checker)
    groups = []
    for i in range(num_running + num_waiting):
        max_tokens = running_max_tokens(i) if i < num_running else 3  # by default one finishes per step
        group = SequenceGroup(f"r{i}", i, None, [2 + i % 5, 3, 4], SamplingParams(max_tokens=max_tokens), [i])
        scheduler.add_group(group)
        groups.append(group)
    return scheduler, processor, groups


def _run_step(scheduler, processor):
    output = scheduler.schedule()
    processor.process(output, [SequenceResult([TokenSample(5, -0.5)]) for _ in output.scheduled])
    return output


@pytest.mark.parametrize("admission_batch, admitted_after", [(1, 1), (2, 2), (3, 3)])
def test_waiting_sequences_are_admitted_once_a_batch_of_them_fits(admission_batch, admitted_after):
    """While everything running decodes, the waiting sequences come in only when `admission_batch` slots are
    free (here one running sequence finishes per step), all at once, so one step prefills instead of one
    per finish; with 1 (vLLM's policy) each is admitted as soon as a slot frees."""
    scheduler, processor, groups = _decoding_scheduler(admission_batch)
    prefill = _run_step(scheduler, processor)
    assert len(prefill.scheduled) == 4 and len(scheduler.waiting) == 3
    admissions = []  # (decode step index, sequences prefilled in it)
    for step in range(8):
        output = _run_step(scheduler, processor)
        prefilled = [item for item in output.scheduled if item.num_new_tokens > 1]
        if prefilled:
            admissions.append((step, len(prefilled)))
    first_step, first_count = admissions[0]
    assert first_count == min(admission_batch, 3), admissions
    # one sequence finishes per step from decode step 1 on; admission waits for `admitted_after` of them
    assert first_step == admitted_after, admissions


def test_the_last_waiting_sequences_are_not_held_for_a_batch_that_cannot_come():
    """Fewer waiting than admission_batch: they come in as soon as they all fit."""
    scheduler, processor, _ = _decoding_scheduler(admission_batch=8, num_waiting=1)
    _run_step(scheduler, processor)
    steps = [_run_step(scheduler, processor) for _ in range(3)]
    assert [sum(item.num_new_tokens > 1 for item in s.scheduled) for s in steps] == [0, 1, 0]


def test_admission_is_held_back_at_most_max_admission_deferral_steps():
    from offline_paged.core import scheduler as scheduler_module

    scheduler, processor, groups = _decoding_scheduler(admission_batch=4, num_running=4, num_waiting=4,
                                                       running_max_tokens=lambda i: 500)  # never free a slot
    _run_step(scheduler, processor)
    scheduler.abort_group(groups[0])  # one slot frees: 1 < 4, so the waiting ones are held back
    held = [_run_step(scheduler, processor) for _ in range(scheduler_module.MAX_ADMISSION_DEFERRAL)]
    assert all(item.num_new_tokens == 1 for output in held for item in output.scheduled)
    admitted = _run_step(scheduler, processor)
    assert sum(item.num_new_tokens > 1 for item in admitted.scheduled) == 1


def test_admission_batch_must_be_positive():
    manager = BlockManager(8, 0, block_size=4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="admission_batch"):
            Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=8, admission_batch=bad)


def test_a_request_still_prefilling_holds_room_for_all_its_samples():
    """n = 3 occupies three sequences once forked, so while its prompt's last chunk is scheduled only one of
    two waiting requests may come in beside it under max_num_seqs = 4 (the fork follows that step)."""
    manager = BlockManager(64, 0, block_size=4, watermark=0.0, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)  # the 10-token prompt: 8 + 2
    processor = OutputProcessor(scheduler, stop_checker)
    for index, (prompt, n) in enumerate((([2, 3, 4, 5, 6] * 2, 3), ([7, 8], 1), ([9, 10], 1))):
        params = SamplingParams(n=n, max_tokens=4, ignore_eos=True)
        seeds = list(range(index * 3, index * 3 + n))
        scheduler.add_group(SequenceGroup(f"r{index}", index, None, prompt, params, seeds))
    admitted = []
    for _ in range(6):
        output = scheduler.schedule()
        admitted.append(sorted(item.seq.group.request_id for item in output.scheduled if item.start == 0))
        processor.process(output, [SequenceResult([TokenSample(5, -0.5)] * item.num_samples)
                                   for item in output.scheduled])
        assert len(scheduler.running) <= 4
    assert admitted[:2] == [["r0"], ["r1"]], admitted  # r2 waits for a slot
