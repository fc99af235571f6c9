"""GpuSampler against the NumPy Sampler (the ground truth) on random logits: every filter, penalty and
their combinations, vocab 49152 and a small one, many seeds and positions. Needs a GPU.

Token ids must agree on >= 99.9% of rows and on every row whose choice is clear: a disagreement is only
accepted where the NumPy keys (penalised logits for greedy rows, p_i / -log u_i for random rows) of the
two candidates agree to 1e-9 relative, i.e. CUDA's exp/log or summation order decided a float64 near-tie.
Raw log-probabilities (the sampled token's and the top-k) agree within 1e-4.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from offline_paged.worker.gpu_sampler import GpuSampler  # noqa: E402
from offline_paged.worker.random_stream import uniform  # noqa: E402
# noqa: E402
from offline_paged.core.sampling_params import SamplingParams  # noqa: E402
from offline_paged.worker.sampler import (Sampler, SamplingRequest, apply_penalties, apply_token_constraints,
                                          filter_logits, log_softmax)

EOS = (2, 7)
NEAR_TIE = 1e-9
CONFIGS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy+penalties": SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                                       presence_penalty=0.2),
    "temperature": SamplingParams(temperature=0.7),
    "hot": SamplingParams(temperature=1.8),
    "top_k": SamplingParams(top_k=40),
    "top_k=1": SamplingParams(top_k=1, temperature=1.0),
    "top_p": SamplingParams(top_p=0.9),
    "top_p_small": SamplingParams(top_p=0.3, temperature=0.5),
    "min_p": SamplingParams(min_p=0.05),
    "top_k+top_p+min_p": SamplingParams(temperature=1.3, top_k=50, top_p=0.8, min_p=0.02),
    "penalties": SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.7),
    "penalties+filters": SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, top_k=20, top_p=0.95),
    "min_tokens": SamplingParams(min_tokens=1000, max_tokens=2000, stop_token_ids=(3, 11)),
    "min_tokens+greedy": SamplingParams(temperature=0.0, min_tokens=1000, max_tokens=2000),
    "logprobs": SamplingParams(logprobs=5, top_p=0.95),
    "logprobs=0+greedy": SamplingParams(temperature=0.0, logprobs=0),
    "logit_bias": SamplingParams(temperature=0.9, logit_bias={3: 4.0, 10: -100.0, 17: 1.5}),
    "allowed_token_ids": SamplingParams(temperature=0.8, allowed_token_ids=[1, 4, 9, 16, 25, 36, 49]),
    "allowed+bias+greedy": SamplingParams(temperature=0.0, allowed_token_ids=[0, 5, 6], logit_bias={5: 2.0}),
    "bad_words": dataclasses.replace(SamplingParams(top_k=5), bad_words=("x",),
                                     _bad_words_token_ids=((5,), (1, 2), (3, 1, 4))),
}


def _requests(params_list, num_rows, vocab, rng):
    requests = []
    for i in range(num_rows):
        params = params_list[i % len(params_list)]
        prompt = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        output = rng.integers(0, min(vocab, 64), int(rng.integers(0, 30))).tolist()  # repeats likely
        seed = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))
        requests.append(SamplingRequest(params, seed, int(rng.integers(0, 5000)), prompt, output))
    return requests


def _logits(num_rows, vocab, rng, rounded=False):
    logits = rng.normal(size=(num_rows, vocab)) * rng.uniform(0.5, 4.0, size=(num_rows, 1))  # [R, V]
    if rounded:  # exact ties: greedy and top-k boundaries must break them like NumPy
        logits = np.round(logits * 2) / 2
    return logits.astype(np.float32)


def _reference_keys(logits, requests, eos) -> np.ndarray:
    """What the NumPy sampler takes the argmax of, per row: [R, V] (-inf = excluded)."""
    adjusted = np.array(logits, dtype=np.float64)  # [R, V]
    sampler = Sampler(eos)
    keys = np.empty_like(adjusted)
    for row, request in enumerate(requests):
        apply_token_constraints(adjusted[row], request)
        apply_penalties(adjusted[row], request)
        sampler._ban_before_min_tokens(adjusted[row], request)
        params = request.params
        if params.temperature == 0.0:
            keys[row] = adjusted[row]
            continue
        filtered = filter_logits(adjusted[row:row + 1] / params.temperature, [params])  # [1, V]
        probs = np.exp(log_softmax(filtered))[0]  # [V]
        u = uniform(np.uint64(request.seed & (2**64 - 1)), np.uint64(request.position),
                    np.arange(adjusted.shape[1], dtype=np.uint64))
        with np.errstate(divide="ignore"):
            keys[row] = np.where(probs > 0.0, probs / (0.0 - np.log(u)), -np.inf)
    return keys


def _compare(logits, requests, label):
    """Sample on both sides; assert agreement as the module docstring says; return the mismatch count."""
    expected = Sampler(EOS).sample(logits, requests)
    device_logits = cupy.asarray(np.concatenate([logits[::-1], logits]))  # rows picked out of a larger array
    got = GpuSampler(EOS).sample(device_logits, list(range(len(requests), 2 * len(requests))), requests)
    want_ids = np.array([r.token_id for r in expected])
    got_ids = np.array([r.token_id for r in got])
    mismatched = np.flatnonzero(want_ids != got_ids)
    if mismatched.size:
        keys = _reference_keys(logits[mismatched], [requests[i] for i in mismatched], EOS)
        for j, row in enumerate(mismatched):
            best, other = keys[j, want_ids[row]], keys[j, got_ids[row]]
            assert np.isfinite(other) and abs(best - other) <= NEAR_TIE * abs(best), (
                f"{label} row {row}: GPU chose {got_ids[row]} (key {other}), NumPy {want_ids[row]} (key {best})")
    assert len(requests) - mismatched.size >= 0.999 * len(requests), f"{label}: {mismatched.size} mismatches"
    for row, (w, g) in enumerate(zip(expected, got)):
        if w.token_id != g.token_id:
            continue
        assert abs(w.logprob - g.logprob) <= 1e-4, (label, row, w.logprob, g.logprob)
        assert (w.top_logprobs is None) == (g.top_logprobs is None), (label, row)
        if w.top_logprobs is not None:
            assert list(w.top_logprobs) == list(g.top_logprobs), (label, row)  # same tokens, best first
            assert np.allclose(list(w.top_logprobs.values()), list(g.top_logprobs.values()), atol=1e-4, rtol=0)
    return int(mismatched.size)


@pytest.mark.parametrize("vocab", [49152, 50])
@pytest.mark.parametrize("label", list(CONFIGS))
def test_each_config_matches_the_numpy_sampler(label, vocab):
    rng = np.random.default_rng(zlib.crc32(f"{label}/{vocab}".encode()))
    num_rows = 192 if vocab > 1000 else 2000
    requests = _requests([CONFIGS[label]], num_rows, vocab, rng)
    mismatches = _compare(_logits(num_rows, vocab, rng), requests, label)
    print(f"gpu sampler {label:20s} V={vocab:5d}: {num_rows - mismatches}/{num_rows} ids equal")


@pytest.mark.parametrize("vocab", [49152, 50])
def test_mixed_batch_matches_and_does_not_depend_on_the_batch(vocab):
    rng = np.random.default_rng(vocab)
    num_rows = 256 if vocab > 1000 else 3000
    requests = _requests(list(CONFIGS.values()), num_rows, vocab, rng)
    logits = _logits(num_rows, vocab, rng)
    mismatches = _compare(logits, requests, "mixed")
    print(f"gpu sampler mixed batch V={vocab}: {num_rows - mismatches}/{num_rows} ids equal")
    together = [r.token_id for r in GpuSampler(EOS).sample(cupy.asarray(logits), list(range(num_rows)), requests)]
    alone = [GpuSampler(EOS).sample(cupy.asarray(logits[i:i + 1]), [0], [requests[i]])[0].token_id
             for i in range(0, num_rows, max(1, num_rows // 40))]
    assert alone == together[::max(1, num_rows // 40)]


@pytest.mark.parametrize("label", ["greedy", "top_k", "top_p", "top_k+top_p+min_p", "min_p"])
def test_exact_ties_break_like_numpy(label):
    rng = np.random.default_rng(5)
    requests = _requests([CONFIGS[label]], 2000, 50, rng)
    _compare(_logits(2000, 50, rng, rounded=True), requests, label + " (ties)")


def test_seed_and_position_drive_the_draw():
    logits = cupy.zeros((400, 1000), dtype=cupy.float32)
    base = SamplingRequest(SamplingParams(), 1, 0, [], [])
    draws = {seed: [r.token_id for r in GpuSampler().sample(
        logits, list(range(400)), [dataclasses.replace(base, seed=seed, position=p) for p in range(400)])]
        for seed in (1, 2)}
    assert sum(a == b for a, b in zip(draws[1], draws[2])) < 10
    assert len(set(draws[1])) > 300  # uniform over 1000 tokens: positions give different draws


def test_launchers_reject_wrong_inputs():
    from offline_paged.ops import sampling_launcher as kernels

    logits = cupy.zeros((2, 8), dtype=cupy.float32)
    with pytest.raises(ValueError, match="rows must be int32"):
        kernels.prepare_rows(logits, cupy.zeros(2, dtype=cupy.int64), cupy.zeros((2, 8)), cupy.zeros((2, 2)))
    with pytest.raises(ValueError, match="adjusted must have shape"):
        kernels.prepare_rows(logits, cupy.zeros(2, dtype=cupy.int32), cupy.zeros((2, 9)), cupy.zeros((2, 2)))
    with pytest.raises(ValueError, match="logits must be float32"):
        kernels.prepare_rows(logits.astype(cupy.float16), cupy.zeros(2, dtype=cupy.int32), cupy.zeros((2, 8)),
                             cupy.zeros((2, 2)))
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.ban_tokens(cupy.zeros((8, 2)).T, cupy.zeros((1, 2), dtype=cupy.int32))
    with pytest.raises(ValueError, match="logits rows for"):
        GpuSampler().sample(logits, [0], [])
