"""Beam search end to end on the tiny random model: width 1 is greedy; wider beams equal a brute-force
beam search over the model's full logits; beams share KV blocks and give them all back; a tiny KV pool
(preemption, idle beams parked) gives exactly the ample pool's results."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from tiny_engine import EOS_ID, ByteTokenizer, run_to_completion, tiny_engine, tiny_model

from offline_paged.core.beam_search import BeamState, beam_score
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.scheduler import Scheduler
from offline_paged.core.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from offline_paged.models.llama import Llama
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.ops.ops_numpy import NumpyOps
from offline_paged.worker.sampler import SampleResult, log_softmax


def beam(width: int, n: int | None = None, **kwargs) -> SamplingParams:
    return SamplingParams(use_beam_search=True, temperature=0.0, n=n or width, best_of=width, **kwargs)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 260, size=n).tolist() for n in lengths]


class ModelLogprobs:
    """Next-token log-probabilities of any token list, each from a fresh full-sequence forward."""

    def __init__(self, model) -> None:
        llama = Llama(model.config, model.weights, NumpyOps(), np.float64)
        self.runner = SimpleRunner(llama, num_blocks=256, block_size=4)

    def __call__(self, token_ids: list[int]) -> np.ndarray:
        row = self.runner.step([(0, token_ids)])[0]  # [V]
        self.runner.free(0)
        return log_softmax(row)  # [V]


def reference_beam_search(next_logprobs, prompt: list[int], width: int, max_tokens: int,
                          stop_ids: frozenset[int], min_tokens: int = 0) -> list[tuple[list[int], float]]:
    """Textbook beam search over the whole vocabulary, run to max_tokens with no early stop:
    the best 2·width (beam, token) pairs by cumulative logprob; stop tokens and max_tokens end a
    hypothesis (scored cum / length, length = prompt + output without a final EOS); the best
    `width` unfinished pairs carry on. Returns (output ids, cumulative logprob), best first."""
    def score(out, cum):
        return cum / (len(prompt) + len(out) - (out[-1] == EOS_ID))

    beams, finished = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for order, (out, cum) in enumerate(beams):
            row = next_logprobs(prompt + out)
            for token in range(row.shape[0]):
                if len(out) < min_tokens and token in stop_ids:
                    continue
                candidates.append((cum + row[token], order, token, out))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = []
        for cum, _, token, out in candidates[:2 * width]:
            if (token in stop_ids and len(out) >= min_tokens) or len(out) + 1 == max_tokens:
                finished.append((out + [token], cum))
            elif len(beams) < width:
                beams.append((out + [token], cum))
        finished = sorted(finished, key=lambda h: score(*h), reverse=True)[:width]
        if not beams:
            break
    return finished


def completions(output) -> list[tuple[list[int], float]]:
    return [(c.token_ids, c.cumulative_logprob) for c in output.outputs]


def test_width_one_is_greedy():
    model = tiny_model()
    batch = prompts(0, [5, 17, 2])
    want = ModelGreedy(model)(batch, 10)
    got = run_to_completion(tiny_engine(model), {
        str(i): (p, beam(1, max_tokens=10, ignore_eos=True)) for i, p in enumerate(batch)})
    assert [got[str(i)].outputs[0].token_ids for i in range(len(batch))] == want


def ModelGreedy(model):
    llama = Llama(model.config, model.weights, NumpyOps(), np.float64)
    return SimpleRunner(llama, num_blocks=256, block_size=4).greedy


def frequent_tokens(model, prompt: list[int], count: int) -> frozenset[int]:
    """Tokens likely to be among a short horizon's candidates: the top ones after the prompt."""
    row = ModelLogprobs(model)(prompt)
    return frozenset(int(t) for t in np.argsort(-row)[1:1 + count])


@pytest.mark.parametrize("width, n, max_tokens, num_stop_ids, min_tokens", [
    (3, 3, 5, 0, 0),
    (4, 2, 6, 0, 0),
    (3, 3, 6, 6, 0),  # stop tokens end hypotheses early: length penalty and the stop bound matter
    (4, 4, 5, 6, 2),  # ...but not before min_tokens
])
def test_matches_a_brute_force_beam_search(width, n, max_tokens, num_stop_ids, min_tokens):
    model = tiny_model()
    prompt = prompts(width + max_tokens, [7])[0]
    stop_ids = frequent_tokens(model, prompt, num_stop_ids)
    params = beam(width, n, max_tokens=max_tokens, min_tokens=min_tokens, logprobs=2,
                  stop_token_ids=sorted(stop_ids), ignore_eos=True)
    out = run_to_completion(tiny_engine(model), {"b": (prompt, params)})["b"]
    want = reference_beam_search(ModelLogprobs(model), prompt, width, max_tokens, stop_ids, min_tokens)[:n]
    got = completions(out)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    np.testing.assert_allclose([c for _, c in got], [c for _, c in want], rtol=0, atol=1e-9)
    if num_stop_ids:
        assert any(len(ids) < max_tokens for ids, _ in got), "no hypothesis ended on a stop token"
    check_shown_logprobs(ModelLogprobs(model), prompt, out, k=2)


def check_shown_logprobs(next_logprobs, prompt, out, k: int) -> None:
    """The user sees the top-k they asked for plus the chosen token, never the runner's wider top."""
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for pos, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = next_logprobs(prompt + completion.token_ids[:pos])
            assert set(entry) == set(np.argsort(-row)[:k].tolist()) | {token}
            assert entry[token] == pytest.approx(row[token], abs=1e-9)


def peak_blocks(engine) -> int:
    stats = engine.stats
    return round(stats.kv_block_usage_peak * stats.num_gpu_blocks)


def test_beams_share_blocks_and_return_them_all():
    model = tiny_model()
    prompt = prompts(11, [61])[0]
    width, max_tokens = 4, 24
    # Prefix caching off on both sides: the sharing measured is the beams' forks alone.
    shared = tiny_engine(model, num_kv_blocks=256, enable_prefix_caching=False)
    run_to_completion(shared, {"b": (prompt, beam(width, max_tokens=max_tokens, ignore_eos=True))})
    # The same number of sequences of the same lengths, each holding its own blocks.
    alone = tiny_engine(model, num_kv_blocks=256, enable_prefix_caching=False)
    run_to_completion(alone, {f"s{i}": (prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True)) for i in range(width)})
    with_sharing, without = peak_blocks(shared), peak_blocks(alone)
    print(f"\nbeam width {width}, 61-token prompt, {max_tokens} new tokens, block 4: peak "
          f"{with_sharing} blocks shared vs {without} for {width} independent sequences "
          f"({1 - with_sharing / without:.0%} saved)")
    assert with_sharing < 0.6 * without
    assert shared.block_manager.num_cow_copies > 0  # beams wrote into shared tail blocks
    manager = shared.block_manager
    assert manager.num_seqs == 0 and manager.num_free_blocks == manager.num_gpu_blocks
    assert manager.gpu_allocator.num_free_blocks == shared.num_gpu_blocks


def test_all_blocks_are_free_after_every_request_finishes_or_aborts():
    engine = tiny_engine()
    batch = prompts(12, [9, 30, 14])
    for i, p in enumerate(batch):
        engine.add_request(str(i), prompt_token_ids=p, params=beam(3, max_tokens=12, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_seqs > 0
    assert engine.abort_request("1")
    while engine.has_unfinished_requests():
        engine.step()
    manager = engine.block_manager
    assert manager.num_seqs == 0 and manager.num_free_blocks == manager.num_gpu_blocks


def beam_workload() -> dict:
    batch = prompts(13, [21, 6, 33, 11, 17])
    requests = {f"b{i}": (p, beam(2 + i % 3, n=1 + i % 2, max_tokens=10 + i, logprobs=1, ignore_eos=True))
                for i, p in enumerate(batch)}
    requests["g"] = (batch[0] + [9, 9], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    requests["s"] = (batch[2][:20], SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=12))
    return requests


def summary(outputs: dict) -> dict:
    return {rid: [(c.token_ids, c.finish_reason, [sorted(e) for e in c.logprobs or []])
                  for c in out.outputs] for rid, out in outputs.items()}


@pytest.fixture(scope="module")
def ample_beams():
    engine = tiny_engine(num_kv_blocks=512, max_num_batched_tokens=256)
    outputs = run_to_completion(engine, beam_workload())
    assert engine.stats.num_preemptions == 0
    return outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_equals_ample_pool(ample_beams, mode, monkeypatch):
    parks = []
    park = Scheduler._park
    monkeypatch.setattr(Scheduler, "_park", lambda self, seq: (parks.append(seq.seq_id), park(self, seq)))
    # 13 blocks of 4 still fit the longest request (max_model_len 52), barely.
    engine = tiny_engine(num_kv_blocks=13, num_cpu_blocks=256, max_num_batched_tokens=8,
                         preemption_mode=mode)
    outputs = run_to_completion(engine, beam_workload())
    stats = engine.stats
    print(f"\n{mode}: {stats.num_preemptions_recompute} recompute / {stats.num_preemptions_swap} swap "
          f"preemptions ({len(parks)} idle beams parked), {stats.num_steps} steps")
    assert stats.num_preemptions > 0 and parks
    assert summary(outputs) == summary(ample_beams)
    for rid, out in ample_beams.items():
        np.testing.assert_allclose([c.cumulative_logprob for c in outputs[rid].outputs],
                                   [c.cumulative_logprob for c in out.outputs], rtol=0, atol=1e-9)
    assert engine.block_manager.num_seqs == 0
    assert engine.block_manager.num_free_blocks == engine.num_gpu_blocks


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1.2), ("presence_penalty", 0.5),
                                          ("frequency_penalty", -0.5)])
def test_penalties_are_rejected(field, value):
    engine = tiny_engine()
    with pytest.raises(ValueError, match=field):
        engine.add_request("x", prompt_token_ids=[5, 6], params=beam(2, **{field: value}))
    assert not engine.has_unfinished_requests()


def test_outputs_are_sorted_by_length_penalised_score_and_eos_ends_a_beam():
    model = tiny_model()
    prompt = prompts(14, [5])[0]
    out = run_to_completion(tiny_engine(model), {"b": (prompt, beam(4, max_tokens=6, stop_token_ids=sorted(
        frequent_tokens(model, prompt, 8))))})["b"]
    scores = [c.cumulative_logprob / (len(prompt) + len(c.token_ids)) for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert len(out.outputs) == 4
    assert {c.finish_reason for c in out.outputs} <= {"stop", "length"}


def test_stop_strings_end_beams_like_the_equivalent_stop_tokens():
    # Byte tokenizer: an ASCII token is one whole character, so stop strings of those characters
    # must end exactly the hypotheses that the token ids end, with the character cut from the text.
    tokens = [45, 99, 66, 52]  # ")", "_", ">", "0": among the likeliest first tokens of this prompt
    prompt = prompts(10, [6])[0]
    common = dict(max_tokens=6, ignore_eos=True)
    by_ids = run_to_completion(tiny_engine(), {"b": (prompt, beam(3, stop_token_ids=tokens, **common))})["b"]
    by_text = run_to_completion(tiny_engine(), {"b": (prompt, beam(3, stop=[chr(t - 4) for t in tokens],
                                                                   **common))})["b"]
    assert completions(by_text) == completions(by_ids)
    stopped = [c for c in by_text.outputs if c.finish_reason == "stop"]
    assert stopped, "no hypothesis ended on a stop string"
    tokenizer = ByteTokenizer()
    for c in stopped:
        assert c.stop_reason == chr(c.token_ids[-1] - 4)
        assert c.text == tokenizer.decode(c.token_ids[:-1])


def one_beam(prompt: list[int], **params) -> tuple[BeamState, Sequence]:
    sampling = SamplingParams(use_beam_search=True, temperature=0.0, n=1, **params)
    state = BeamState(beam_width=1, max_len=len(prompt) + sampling.max_tokens)
    group = SequenceGroup("r", 0, None, prompt, sampling, [0], beam=state)
    seq = Sequence(0, group, 0, 0, list(prompt), len(prompt), status=SequenceStatus.RUNNING)
    group.seqs.append(seq)
    return state, seq


def stop_on(token_id: int):
    return lambda seq: (FinishReason.STOP, token_id) if seq.token_ids[-1] == token_id else None


@pytest.mark.parametrize("live_logprob, done", [
    (-0.2, False),  # -0.2 / 14 > -0.1 / 5: a longer future could still beat the hypothesis
    (-0.5, True),  # -0.5 / 14 <= -0.1 / 5: nothing it grows into can
])
def test_stops_only_when_no_live_beam_can_beat_the_hypotheses(live_logprob, done):
    # vLLM's early_stopping=False would compare -0.2 / 5 (current length) and stop in both cases.
    state, seq = one_beam([4, 5, 6, 7], max_tokens=10)
    state.add_result(seq, SampleResult(9, -0.1, {9: -0.1, 8: live_logprob}))
    step = state.step([seq], stop_on(9), itertools.count(1).__next__)
    assert [h.token_ids[-1] for h in state.hypotheses] == [9]
    assert beam_score(state.hypotheses[0]) == pytest.approx(-0.1 / 5)
    assert step.done is done
    assert [child.token_ids[-1] for child, _ in step.children] == ([] if done else [8])
    assert not state.pending
