"""Preemption is invisible: a job on a tiny KV pool (forcing recompute or swap preemption) yields exactly
the outputs of the same job on an ample pool — tokens, text, finish reasons, logprobs."""
from __future__ import annotations

import numpy as np
import pytest
from tiny_engine import run_to_completion, tiny_engine

from offline_paged.core.sampling_params import SamplingParams


def workload() -> dict:
    rng = np.random.default_rng(7)
    shared = rng.integers(4, 260, size=12).tolist()  # a shared "system prompt" for prefix hits
    requests = {}
    for i in range(10):
        prompt = rng.integers(4, 260, size=int(rng.integers(3, 36))).tolist()
        if i % 3 == 0:
            prompt = shared + prompt
        if i % 2:
            params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 28)), logprobs=1)
        else:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i,
                                    max_tokens=int(rng.integers(8, 28)))
        requests[f"r{i}"] = (prompt, params)
    requests["n3"] = (shared + [50, 60, 70], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20))
    requests["plp"] = (shared + [80, 90], SamplingParams(prompt_logprobs=2, temperature=0.0, max_tokens=6))
    return requests


def summary(outputs: dict) -> dict:
    return {
        request_id: (
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs],
            [sorted(lp.items()) for c in out.outputs for lp in (c.logprobs or [])],
            out.prompt_logprobs and [sorted(e.items()) if e else None for e in out.prompt_logprobs],
        )
        for request_id, out in outputs.items()
    }


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for request_id in want:
        got_tokens, got_lps, got_prompt = got[request_id]
        want_tokens, want_lps, want_prompt = want[request_id]
        assert got_tokens == want_tokens, f"{request_id}: tokens differ after preemption"
        assert len(got_lps) == len(want_lps)
        for g, w in zip(got_lps, want_lps):
            assert [t for t, _ in g] == [t for t, _ in w]
            np.testing.assert_allclose([v for _, v in g], [v for _, v in w], rtol=0, atol=1e-9)
        assert (got_prompt is None) == (want_prompt is None)
        if want_prompt:
            assert len(got_prompt) == len(want_prompt)
            for g, w in zip(got_prompt[1:], want_prompt[1:]):
                assert [t for t, _ in g] == [t for t, _ in w]
                np.testing.assert_allclose([v for _, v in g], [v for _, v in w], atol=1e-9)


@pytest.fixture(scope="module")
def ample():
    engine = tiny_engine(num_kv_blocks=512, max_num_batched_tokens=256)
    outputs = run_to_completion(engine, workload())
    assert engine.stats.num_preemptions == 0
    return summary(outputs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preempts_and_matches_ample_pool(ample, mode):
    engine = tiny_engine(num_kv_blocks=24, num_cpu_blocks=256, max_num_batched_tokens=16,
                         preemption_mode=mode)
    outputs = run_to_completion(engine, workload())
    stats = engine.stats
    print(f"\n{mode}: {stats.num_preemptions_recompute} recompute / {stats.num_preemptions_swap} swap "
          f"preemptions, prefix hit rate {stats.prefix_cache_hit_rate:.2f}, {stats.num_steps} steps")
    if mode == "recompute":
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    else:
        assert stats.num_preemptions_swap > 0
    assert_same(summary(outputs), ample)


def test_swap_falls_back_to_recompute_without_cpu_room(ample):
    engine = tiny_engine(num_kv_blocks=24, num_cpu_blocks=2, max_num_batched_tokens=16,
                         preemption_mode="swap")
    outputs = run_to_completion(engine, workload())
    assert engine.stats.num_preemptions_recompute > 0
    assert_same(summary(outputs), ample)
