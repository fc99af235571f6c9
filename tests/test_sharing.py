"""Sharing saves memory: n=4 samples forked from one prompt, and requests sharing a system prompt, hold
fewer KV blocks at their peak than the same sequences run unshared — and produce the same tokens."""
from __future__ import annotations

import numpy as np
from tiny_engine import run_to_completion, tiny_engine

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.worker.random_stream import stream_seed


def peak_blocks(engine) -> int:
    stats = engine.stats
    return round(stats.kv_block_usage_peak * stats.num_gpu_blocks)


def test_parallel_samples_share_the_prompt_blocks():
    prompt = np.random.default_rng(1).integers(4, 260, size=61).tolist()
    params = dict(temperature=1.0, max_tokens=24, ignore_eos=True)

    shared = tiny_engine(num_kv_blocks=256)
    forked = run_to_completion(shared, {"n4": (prompt, SamplingParams(n=4, seed=9, **params))})

    unshared = tiny_engine(num_kv_blocks=256, enable_prefix_caching=False)
    separate = run_to_completion(unshared, {
        f"s{i}": (prompt, SamplingParams(seed=stream_seed(9, i), **params)) for i in range(4)
    })

    forked_tokens = [c.token_ids for c in forked["n4"].outputs]
    assert forked_tokens == [separate[f"s{i}"].outputs[0].token_ids for i in range(4)]
    assert len({tuple(t) for t in forked_tokens}) > 1, "the samples should differ"
    with_sharing, without = peak_blocks(shared), peak_blocks(unshared)
    print(f"\nn=4, 61-token prompt, 24 new tokens, block 4: peak {with_sharing} blocks shared vs "
          f"{without} unshared ({1 - with_sharing / without:.0%} saved)")
    assert with_sharing < without


def test_shared_system_prompt_hits_the_prefix_cache():
    rng = np.random.default_rng(2)
    system = rng.integers(4, 260, size=40).tolist()
    requests = {
        f"q{i}": (system + rng.integers(4, 260, size=6).tolist(),
                  SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for i in range(6)
    }
    cached = tiny_engine(num_kv_blocks=256)
    with_cache = run_to_completion(cached, requests)
    uncached = tiny_engine(num_kv_blocks=256, enable_prefix_caching=False)
    without_cache = run_to_completion(uncached, requests)

    for request_id in requests:
        assert with_cache[request_id].outputs[0].token_ids == without_cache[request_id].outputs[0].token_ids
    hits = cached.stats.num_cached_prompt_tokens
    with_sharing, without = peak_blocks(cached), peak_blocks(uncached)
    print(f"\n6 requests, 40-token system prompt: {hits} prompt tokens from the prefix cache, "
          f"peak {with_sharing} blocks shared vs {without} unshared ({1 - with_sharing / without:.0%} saved)")
    # Requests admitted after the first prompt's blocks were computed reuse its 10 full blocks.
    assert hits >= 4 * 40
    assert uncached.stats.num_cached_prompt_tokens == 0
    assert with_sharing < without


def test_requests_admitted_in_the_same_step_share_a_system_prompt_computed_in_that_step():
    """A batch job's first step admits everything at once: the system prompt's blocks, written by the
    first request in that step's forward, are reused by the others of the same step."""
    rng = np.random.default_rng(3)
    system = rng.integers(4, 260, size=40).tolist()  # 10 full blocks of 4
    requests = {
        f"q{i}": (system + rng.integers(4, 260, size=6).tolist(),
                  SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        for i in range(6)
    }
    cached = tiny_engine(max_num_batched_tokens=1024)
    for request_id, (prompt_ids, params) in requests.items():
        cached.add_request(request_id, prompt_token_ids=prompt_ids, params=params)
    finished = {o.request_id: o for o in cached.step()}  # one step prefills all six prompts
    assert cached.stats.num_cached_prompt_tokens == 5 * 40
    while cached.has_unfinished_requests():
        finished |= {o.request_id: o for o in cached.step()}

    uncached = tiny_engine(max_num_batched_tokens=1024, enable_prefix_caching=False)
    without_cache = run_to_completion(uncached, requests)
    for request_id in requests:
        assert finished[request_id].outputs[0].token_ids == without_cache[request_id].outputs[0].token_ids
