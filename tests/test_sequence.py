"""Sequence / SequenceGroup bookkeeping: appending, forking, forgetting the cache on preemption."""
from __future__ import annotations

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus, TokenSample


def make_seq(n: int = 1, logprobs: int | None = 2, prompt_logprobs: int | None = None) -> Sequence:
    params = SamplingParams(n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    group = SequenceGroup("r", 3, None, [7, 8, 9], params, list(range(n)),
                          prompt_logprobs=[None] if prompt_logprobs is not None else None)
    seq = Sequence(0, group, 0, 0, [7, 8, 9], 3, logprobs=[] if logprobs is not None else None)
    group.seqs.append(seq)
    return seq


def test_append_token_records_the_sampled_logprob_next_to_the_top_k():
    seq = make_seq()
    seq.append_token(TokenSample(5, -0.5, {4: -0.1, 6: -0.3}))
    seq.append_token(TokenSample(4, -0.2, {4: -0.2}))
    assert seq.output_token_ids == [5, 4] and seq.num_output_tokens == 2
    assert seq.logprobs == [{4: -0.1, 6: -0.3, 5: -0.5}, {4: -0.2}]
    assert seq.cumulative_logprob == -0.7
    assert seq.num_uncomputed_tokens == 5


def test_fork_shares_nothing_mutable():
    seq = make_seq(n=2)
    seq.num_computed_tokens = seq.num_slots = 3
    child = seq.fork(1, 1, 99)
    child.append_token(TokenSample(11, -1.0))
    assert seq.token_ids == [7, 8, 9] and seq.logprobs == []
    assert child.token_ids == [7, 8, 9, 11] and child.sampling_seed == 99
    assert (child.num_computed_tokens, child.num_slots, child.priority) == (3, 3, (3, 1))


def test_forget_cache_keeps_tokens_but_drops_kv_bookkeeping():
    seq = make_seq()
    seq.status = SequenceStatus.RUNNING
    seq.append_token(TokenSample(5, -0.5))
    seq.num_computed_tokens, seq.num_slots, seq.num_skip_write = 3, 4, 2
    seq.forget_cache()
    assert seq.token_ids == [7, 8, 9, 5]
    assert (seq.status, seq.num_computed_tokens, seq.num_slots, seq.num_skip_write) == \
        (SequenceStatus.WAITING, 0, 0, 0)


def test_group_finishes_only_after_forking_and_every_sample_ends():
    seq = make_seq(n=2)
    group = seq.group
    assert group.needs_fork and group.num_pending_seqs == 2
    seq.status = SequenceStatus.RUNNING
    child = seq.fork(1, 1, 1)
    seq.finish(FinishReason.LENGTH)
    assert not group.is_finished  # the second sample is not forked yet
    group.forked = True
    group.seqs.append(child)
    assert not group.is_finished
    child.finish(FinishReason.STOP, 1)
    assert group.is_finished and group.num_pending_seqs == 1


def test_prompt_logprobs_wanted_until_every_prompt_position_is_scored():
    group = make_seq(prompt_logprobs=1).group
    assert group.wants_prompt_logprobs
    group.prompt_logprobs += [{8: -1.0}, {9: -2.0}]
    assert not group.wants_prompt_logprobs
