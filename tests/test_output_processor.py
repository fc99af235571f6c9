"""OutputProcessor (core/output_processor.py) on a real Scheduler and BlockManager: sampled tokens land in
the right sequences, the first n-sample row forks the request, the stop checker finishes sequences,
results that do not match the step are refused; prompt logprobs skip re-scored positions."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from offline_paged.core.block_manager import BlockManager
from offline_paged.core.config import PreemptionMode
from offline_paged.core.output_processor import OutputProcessor, _extend_prompt_logprobs
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.scheduler import Scheduler
from offline_paged.core.sequence import FinishReason, SequenceGroup, SequenceResult, TokenSample


def _setup(n: int, max_tokens: int, prompt_len: int, rng):
    scheduler = Scheduler(BlockManager(64, 0, 4, watermark=0.0, enable_prefix_caching=False), 8, 64,
                          PreemptionMode.RECOMPUTE)

    def stop(seq):  # stops on token 0, else at max_tokens
        if seq.token_ids[-1] == 0:
            return FinishReason.STOP, 0
        return (FinishReason.LENGTH, None) if seq.num_known_output_tokens >= max_tokens else None

    prompt = rng.integers(1, 50, size=prompt_len).tolist()
    group = SequenceGroup("r0", 0, None, prompt, SamplingParams(n=n, max_tokens=max_tokens), list(range(n)))
    scheduler.add_group(group)
    return scheduler, OutputProcessor(scheduler, stop), group


def test_tokens_reach_their_sequences_and_the_request_forks_once():
    rng = np.random.default_rng(21)
    scheduler, processor, group = _setup(n=3, max_tokens=4, prompt_len=9, rng=rng)
    finished, forks = [], 0
    for _ in range(20):
        output = scheduler.schedule()
        if not output.scheduled:
            break
        sent = [rng.integers(1, 50, size=item.num_samples).tolist() for item in output.scheduled]  # no 0: no STOP
        before = {seq.seq_id: list(seq.output_token_ids) for seq in group.seqs}
        finished += processor.process(output, [SequenceResult([TokenSample(t, -1.0) for t in tokens])
                                               for tokens in sent])
        for item, tokens in zip(output.scheduled, sent):
            if len(tokens) > 1:  # the prompt row: sample i goes to the request's i-th sequence
                forks += 1
                assert [seq.output_token_ids for seq in group.seqs] == [[t] for t in tokens]
            elif tokens:
                assert item.seq.output_token_ids == before[item.seq.seq_id] + tokens
    assert forks == 1 and finished == [group] and group.is_finished and group.forked
    assert len(group.seqs) == 3 and all(len(seq.output_token_ids) == 4 for seq in group.seqs)
    assert len({seq.seq_id for seq in group.seqs}) == 3


def test_stop_token_finishes_one_sample_only():
    rng = np.random.default_rng(22)
    scheduler, processor, group = _setup(n=2, max_tokens=6, prompt_len=5, rng=rng)
    output = scheduler.schedule()
    [item] = output.scheduled
    assert item.num_samples == 2
    processor.process(output, [SequenceResult([TokenSample(0, -0.5), TokenSample(7, -0.5)])])
    first, second = group.seqs
    assert first.is_finished and first.output_token_ids == [0]
    assert not second.is_finished and second.output_token_ids == [7]


def test_results_that_do_not_match_the_step_are_refused():
    rng = np.random.default_rng(23)
    scheduler, processor, _ = _setup(n=2, max_tokens=3, prompt_len=5, rng=rng)
    output = scheduler.schedule()
    with pytest.raises(RuntimeError, match="runner returned 0 results for 1 sequences"):
        processor.process(output, [])
    with pytest.raises(RuntimeError, match="expected 2 samples, got 1"):
        processor.process(output, [SequenceResult([TokenSample(3, -1.0)])])


def test_prompt_logprobs_keep_only_new_positions():
    rng = np.random.default_rng(24)
    entries = [{int(t): float(-rng.random())} for t in rng.integers(0, 99, size=8)]
    group = SimpleNamespace(request_id="r", prompt_logprobs=[None],
                            params=SimpleNamespace(prompt_logprobs_start=0))
    _extend_prompt_logprobs(group, 0, entries[:5])  # positions 1..5
    _extend_prompt_logprobs(group, 3, entries[3:8])  # re-prefill from 3 scores 4..8: 4, 5 again
    assert group.prompt_logprobs == [None] + entries[:5] + entries[5:8]
    with pytest.raises(RuntimeError, match="prompt logprobs of 'r' would skip positions"):
        _extend_prompt_logprobs(group, 12, entries)
    late = SimpleNamespace(request_id="s", prompt_logprobs=[None], params=SimpleNamespace(prompt_logprobs_start=3))
    _extend_prompt_logprobs(late, 0, entries[:4])
    assert late.prompt_logprobs == [None, None, None] + entries[2:4]


class _ScriptedMatcher:
    """A grammar matcher fed ahead whose mask server has not answered yet: `accept` is the wait for its
    outcome (it records how many of the step's tokens had been appended by then), then (error, finished)
    as scripted."""

    def __init__(self, error: str | None, finished: bool, appended_so_far, calls: list) -> None:
        self.error, self.finished, self.appended_so_far, self.calls = error, finished, appended_so_far, calls
        self.outcome_pending = True
        self.is_finished = False

    def accept(self, token_id: int) -> str | None:
        self.calls.append((token_id, self.appended_so_far()))
        self.outcome_pending = False
        self.is_finished = self.finished
        return self.error


@pytest.mark.parametrize("max_tokens", [1, 5], ids=["length_hit_too", "running"])
def test_grammar_outcomes_still_pending_are_settled_after_the_step_s_other_sequences(max_tokens):
    """With core's StopChecker, a sequence whose grammar outcome is still being computed is checked for
    everything else in step order, and its outcome read once every sequence of the step was seen: a refused
    token ends it with ABORT and the error whatever ended it meanwhile (the grammar is checked first); a
    completed grammar ends it with STOP unless something else already did (it is checked last)."""
    from offline_paged.core.stop_checker import StopChecker
    from tiny_engine import EOS_ID, ByteTokenizer

    scheduler = Scheduler(BlockManager(64, 0, 4, watermark=0.0, enable_prefix_caching=False), 8, 64,
                          PreemptionMode.RECOMPUTE)
    processor = OutputProcessor(scheduler, StopChecker(ByteTokenizer(), (EOS_ID,), max_model_len=64))
    scripts = {"refused": ("token 9 is not allowed", False), "done": (None, True), "open": (None, False)}
    groups = {}
    for index, name in enumerate(scripts):
        group = SequenceGroup(name, index, None, [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              [0])
        scheduler.add_group(group)
        groups[name] = group
    output = scheduler.schedule()
    seqs = [item.seq for item in output.scheduled]
    calls: list = []

    def appended_so_far() -> int:
        return sum(len(seq.output_token_ids) for seq in seqs)

    for seq in seqs:
        seq.matcher = _ScriptedMatcher(*scripts[seq.group.request_id], appended_so_far, calls)
    finished = processor.process(output, [SequenceResult([TokenSample(9, -1.0)])] * len(seqs))
    assert calls == [(9, 3)] * 3  # every outcome read after the step's three tokens were appended
    refused, done, still_open = (groups[name].seqs[0] for name in scripts)
    assert refused.finish_reason is FinishReason.ABORT and refused.error == "token 9 is not allowed"
    if max_tokens == 1:  # every one hit its length first: the grammar's completion does not override it
        assert done.finish_reason is FinishReason.LENGTH and still_open.finish_reason is FinishReason.LENGTH
        assert set(finished) == set(groups.values())
    else:
        assert done.finish_reason is FinishReason.STOP and not still_open.is_finished
        assert set(finished) == {groups["refused"], groups["done"]}
    assert scheduler.block_manager.num_free_blocks == 64 - (0 if max_tokens == 1 else 1)
