"""Sampler: each filter on hand-computable cases, statistics of the race, penalties, logprobs."""
import math

import numpy as np
import pytest

import offline_paged.worker.sampler as sampler_module
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.worker.sampler import (SamplingRequest, Sampler, apply_penalties, filter_logits, log_softmax,
                                          top_logprobs)

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS).astype(np.float32)  # softmax(LOGITS) == PROBS


def _request(params=None, seed=0, position=0, prompt=(), output=()):
    return SamplingRequest(params or SamplingParams(), seed, position, list(prompt), list(output))


def _kept(params: SamplingParams, logits=LOGITS) -> set[int]:
    filtered = filter_logits(np.asarray(logits, np.float64)[None, :], [params])[0]
    return set(np.flatnonzero(np.isfinite(filtered)).tolist())


def _draw(params: SamplingParams, num_draws=20_000, logits=LOGITS, seed=1234) -> np.ndarray:
    """Frequencies of tokens over num_draws positions of one seeded stream."""
    batch = np.repeat(np.asarray(logits, np.float32)[None, :], num_draws, axis=0)
    requests = [_request(params, seed=seed, position=p) for p in range(num_draws)]
    tokens = [r.token_id for r in Sampler().sample(batch, requests)]
    return np.bincount(tokens, minlength=len(logits)) / num_draws


def _assert_matches(freqs: np.ndarray, expected: np.ndarray, num_draws=20_000):
    sigma = np.sqrt(expected * (1 - expected) / num_draws) + 1e-12
    assert np.all(np.abs(freqs - expected) <= 5 * sigma + 1e-9), (freqs, expected)


def test_log_softmax_hand_case():
    got = log_softmax(np.array([[0.0, math.log(3.0)]], np.float32))
    assert np.allclose(np.exp(got), [[0.25, 0.75]])
    assert np.allclose(log_softmax(np.array([1000.0, 1000.0])), [-math.log(2)] * 2)


def test_top_k_hand_case_keeps_the_k_largest():
    assert _kept(SamplingParams(top_k=2)) == {0, 1}
    assert _kept(SamplingParams(top_k=1)) == {0}
    assert _kept(SamplingParams(top_k=10)) == {0, 1, 2, 3}


def test_top_k_keeps_ties_at_the_boundary():
    assert _kept(SamplingParams(top_k=2), logits=[3.0, 1.0, 1.0, 0.0]) == {0, 1, 2}


@pytest.mark.parametrize(("top_p", "kept"), [
    (0.45, {0}), (0.55, {0, 1}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3}),
])
def test_top_p_hand_case_keeps_the_smallest_set_reaching_p(top_p, kept):
    assert _kept(SamplingParams(top_p=top_p)) == kept


def test_top_p_applies_after_top_k_renormalisation():
    # alone, top_p=0.83 keeps token 2 (mass before it 0.8); after top_k=3 renormalises to
    # [0.526, 0.316, 0.158] the mass before token 2 is 0.842, so it goes
    assert _kept(SamplingParams(top_p=0.83)) == {0, 1, 2}
    assert _kept(SamplingParams(top_k=3, top_p=0.83)) == {0, 1}


@pytest.mark.parametrize(("min_p", "kept"), [(0.05, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.4, {0, 1}),
                                             (0.9, {0})])
def test_min_p_hand_case_keeps_tokens_above_a_fraction_of_the_best(min_p, kept):
    assert _kept(SamplingParams(min_p=min_p)) == kept


def test_penalties_follow_the_vllm_formulas():
    row = np.array([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(row, _request(params, prompt=[0], output=[1, 1, 2]))
    # repetition on {0, 1, 2}: [1, -2, 0.25, 3]; frequency counts [0, 2, 1, 0]; presence [0,1,1,0]
    assert np.allclose(row, [1.0, -2.0 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, 3.0])


def test_presence_and_frequency_ignore_prompt_tokens():
    row = np.array([1.0, 1.0])
    apply_penalties(row, _request(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0),
                                  prompt=[0, 0], output=[]))
    assert row.tolist() == [1.0, 1.0]


def test_penalty_rejects_token_ids_outside_the_vocab():
    with pytest.raises(ValueError, match="token ids"):
        apply_penalties(np.zeros(3), _request(SamplingParams(repetition_penalty=1.5), prompt=[3]))


def test_greedy_is_argmax_after_penalties():
    logits = np.array([[0.1, 2.0, 1.9, -1.0], [5.0, 4.0, 0.0, 0.0]], np.float32)
    greedy = SamplingParams(temperature=0)
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = Sampler().sample(logits, [_request(greedy), _request(penalised, output=[0])])
    assert [r.token_id for r in out] == [1, 1]


def test_sampling_matches_the_distribution():
    _assert_matches(_draw(SamplingParams()), PROBS)


def test_temperature_reshapes_the_distribution():
    expected = np.exp(log_softmax(LOGITS / 0.5))
    _assert_matches(_draw(SamplingParams(temperature=0.5)), expected)


@pytest.mark.parametrize(("params", "kept"), [
    (SamplingParams(top_k=2), [0, 1]),
    (SamplingParams(top_p=0.7), [0, 1]),
    (SamplingParams(min_p=0.2), [0, 1, 2]),
])
def test_filters_never_emit_excluded_tokens_and_renormalise(params, kept):
    freqs = _draw(params)
    expected = np.zeros_like(PROBS)
    expected[kept] = PROBS[kept] / PROBS[kept].sum()
    assert np.all(freqs[expected == 0] == 0)
    _assert_matches(freqs, expected)


def test_draw_depends_only_on_seed_and_position_not_on_the_batch():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    requests = [_request(SamplingParams(top_p=0.9), seed=s, position=p)
                for s, p in zip(range(6), (0, 3, 3, 7, 1, 2))]
    together = [r.token_id for r in Sampler().sample(logits, requests)]
    alone = [Sampler().sample(logits[i:i + 1], [requests[i]])[0].token_id for i in range(6)]
    reversed_batch = Sampler().sample(logits[::-1].copy(), requests[::-1])
    assert together == alone == [r.token_id for r in reversed_batch][::-1]


def test_different_seeds_give_different_samples():
    logits = np.zeros((200, 1000), np.float32)
    a = [r.token_id for r in Sampler().sample(logits, [_request(seed=1, position=p) for p in range(200)])]
    b = [r.token_id for r in Sampler().sample(logits, [_request(seed=2, position=p) for p in range(200)])]
    assert sum(x == y for x, y in zip(a, b)) < 10


def test_uniform_of_exactly_one_never_selects_an_excluded_token(monkeypatch):
    def all_ones(seed, position, index):
        return np.ones(np.broadcast_shapes(np.shape(seed), np.shape(index)))

    monkeypatch.setattr(sampler_module, "uniform", all_ones)
    out = Sampler().sample(LOGITS[None, :], [_request(SamplingParams(top_k=2))])
    assert out[0].token_id in {0, 1}


def test_logprobs_are_raw_model_logprobs_whatever_the_penalties():
    params = SamplingParams(temperature=0.3, repetition_penalty=1.7, top_k=2, logprobs=2)
    out = Sampler().sample(LOGITS[None, :], [_request(params, output=[0])])[0]
    raw = np.log(PROBS)
    assert out.logprob == pytest.approx(raw[out.token_id], abs=1e-6)
    assert list(out.top_logprobs)[:2] == [0, 1]
    assert out.top_logprobs[0] == pytest.approx(raw[0], abs=1e-6)


def test_top_logprobs_adds_the_chosen_token_and_zero_means_chosen_only():
    row = np.log(PROBS)
    assert top_logprobs(row, 1, chosen=3) == pytest.approx({0: row[0], 3: row[3]})
    assert list(top_logprobs(row, 0, chosen=2)) == [2]
    out = Sampler().sample(LOGITS[None, :], [_request(SamplingParams(logprobs=0))])[0]
    assert list(out.top_logprobs) == [out.token_id]
    assert Sampler().sample(LOGITS[None, :], [_request()])[0].top_logprobs is None


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = np.array([[0.0, 10.0, 9.0, 0.0]], np.float32)  # eos = 1, stop id = 2
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler(eos_token_ids=[1])
    assert sampler.sample(logits, [_request(params, position=1, output=[0])])[0].token_id in {0, 3}
    assert sampler.sample(logits, [_request(params, position=2, output=[0, 0])])[0].token_id == 1
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler.sample(logits, [_request(ignore)])[0].token_id == 1


def test_shape_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(np.zeros((2, 4), np.float32), [_request()])
