"""StatsTracker's KV slot utilization (BlockManager.slot_utilization: tail entries only) equals
BlockManager.utilization (the whole-table walk that defines it) after every schedule, whatever shares
blocks: prefix-cache hits, n > 1 forks, beam search, recompute and swap preemption, and the contiguous
layout's reserved empty blocks."""
from __future__ import annotations

import random

import pytest

from offline_paged.core.sampling_params import SamplingParams

from tiny_engine import tiny_engine


def _requests(seed: int) -> dict:
    rng = random.Random(seed)
    shared = [rng.randrange(4, 260) for _ in range(11)]  # a common prefix: prefix-cache hits
    requests = {}
    for i in range(12):
        prompt = (shared if i % 2 else []) + [rng.randrange(4, 260) for _ in range(rng.randint(1, 13))]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=9, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(use_beam_search=True, temperature=0.0, n=1, best_of=2, max_tokens=6,
                                    ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 15), ignore_eos=True)
        requests[f"r{i}"] = (prompt, params)
    return requests


@pytest.mark.parametrize("overrides", [
    {},
    {"num_kv_blocks": 24, "preemption_mode": "recompute"},
    {"num_kv_blocks": 24, "preemption_mode": "swap", "num_cpu_blocks": 64},
    {"kv_layout": "contiguous", "max_model_len": 40, "num_kv_blocks": 160},
])
def test_slot_utilization_equals_the_table_walk(overrides):
    engine = tiny_engine(**overrides)
    schedule, checked = engine.scheduler.schedule, []

    def checked_schedule():
        output = schedule()
        manager = engine.scheduler.block_manager
        checked.append((manager.slot_utilization(), manager.utilization))
        return output

    engine.scheduler.schedule = checked_schedule
    for request_id, (prompt, params) in _requests(len(overrides)).items():
        engine.add_request(request_id, prompt_token_ids=prompt, params=params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 10
    assert any(0.0 < walk < 1.0 for _, walk in checked)  # part-filled blocks did occur
    for fast, walk in checked:
        assert fast == pytest.approx(walk, abs=1e-12)
