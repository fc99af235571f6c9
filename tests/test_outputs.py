"""core/outputs.py: the engine's float logprob dicts become vLLM's Logprob records with the right ranks,
and EngineStats' derived fields."""
from __future__ import annotations

import dataclasses

import numpy as np

from offline_paged.core.outputs import CompletionOutput, EngineStats, Logprob, to_logprob_dicts


def test_logprob_dicts_rank_the_top_k_and_leave_the_extra_chosen_token_unranked():
    rng = np.random.default_rng(5)
    for num_top in (0, 1, 3):
        entries = [None]
        for _ in range(4):
            ids = rng.choice(1000, size=num_top + 1, replace=False).tolist()  # top-k, then the chosen one
            values = np.sort(-rng.random(num_top + 1))[::-1].tolist()
            entries.append(dict(zip(ids, values)))
        got = to_logprob_dicts(entries, num_top, lambda i: f"<{i}>")
        assert got[0] is None
        for entry, converted in zip(entries[1:], got[1:]):
            assert list(converted) == list(entry)  # order kept: best first
            for rank, (token_id, record) in enumerate(converted.items()):
                assert record == Logprob(entry[token_id], rank + 1 if rank < num_top else None, f"<{token_id}>")


def test_logprob_dicts_without_decode_or_entries():
    assert to_logprob_dicts(None, 2, None) is None
    [converted] = to_logprob_dicts([{7: -0.25, 3: -1.5}], 2, None)
    assert converted == {7: Logprob(-0.25, 1, None), 3: Logprob(-1.5, 2, None)}


def test_engine_stats_dict_has_every_field_and_preemptions_add_up():
    rng = np.random.default_rng(6)
    names = [f.name for f in dataclasses.fields(EngineStats)]
    values = {name: int(rng.integers(0, 1000)) for name in names}
    stats = EngineStats(**values)
    assert stats.to_dict() == values
    assert stats.num_preemptions == values["num_preemptions_recompute"] + values["num_preemptions_swap"]


def test_completion_finished_follows_finish_reason():
    args = dict(index=0, text="x", token_ids=[1], cumulative_logprob=None, logprobs=None)
    assert not CompletionOutput(finish_reason=None, **args).finished()
    assert CompletionOutput(finish_reason="length", **args).finished()
