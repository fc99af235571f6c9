"""SamplingRows and the per-row parameter packing both GPU samplers share (CPU: pure NumPy)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.worker.sampling_rows import (PARAMS_WIDTH, SamplingRows, ban_until, graph_samplable,
                                                pack_params, pack_seeds)


def test_pack_params_layout_matches_the_kernels():
    params = [SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05), SamplingParams(temperature=0.0)]
    packed = pack_params(params)
    assert packed.shape == (2, PARAMS_WIDTH) and packed.dtype == np.float64
    np.testing.assert_array_equal(packed[0], [0.7, 0.05, 0.0, 0.9, 40, 0, 0, 0])
    np.testing.assert_array_equal(packed[1], [0.0, 0.0, 1.0, 1.0, 0, 0, 0, 0])
    assert pack_params([]).shape == (0, PARAMS_WIDTH)


def test_pack_params_matches_the_launcher_constant():
    source = (Path(__file__).resolve().parents[1] / "offline_paged" / "ops" / "sampling_launcher.py").read_text(encoding="utf-8")
    assert re.search(r"^PARAMS_WIDTH = (\d+)$", source, re.M).group(1) == str(PARAMS_WIDTH)


def test_pack_seeds_wraps_modulo_2_64():
    np.testing.assert_array_equal(pack_seeds([0, -1, 2**64 + 5]), np.array([0, 2**64 - 1, 5], dtype=np.uint64))


@pytest.mark.parametrize("params, ok", [
    (SamplingParams(), True), (SamplingParams(temperature=0.0), True),
    (SamplingParams(top_k=5, top_p=0.8, min_p=0.1), True),
    (SamplingParams(logprobs=0), False), (SamplingParams(repetition_penalty=1.2), False),
    (SamplingParams(presence_penalty=0.5), False), (SamplingParams(frequency_penalty=0.5), False),
    (SamplingParams(allowed_token_ids=(1, 2)), False), (SamplingParams(logit_bias={3: 1.0}), False),
    (SamplingParams(structured_outputs={"regex": "[0-9]+"}), True),  # the graph's masked sampler
    (SamplingParams(structured_outputs={"regex": "[0-9]+"}, logprobs=1), False),
])
def test_graph_samplable_keeps_penalties_logprobs_and_constraints_eager(params, ok):
    assert graph_samplable(params, beam=False) is ok
    assert graph_samplable(params, beam=True) is False


def test_ban_until_only_when_something_is_banned():
    assert ban_until(SamplingParams(min_tokens=4), eos_token_ids=(2,)) == 4
    assert ban_until(SamplingParams(min_tokens=4, ignore_eos=True), eos_token_ids=(2,)) == 0
    assert ban_until(SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=(7,)), eos_token_ids=(2,)) == 4
    assert ban_until(SamplingParams(min_tokens=4), eos_token_ids=()) == 0


def _describer(table):
    return lambda i: table[i]


def test_rows_are_packed_once_and_repacked_when_the_sequence_changes():
    rows = SamplingRows(eos_token_ids=(2,), num_rows=4)
    a, b = SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=0.0)
    calls = []

    def describe(i):
        calls.append(i)
        return [(a, 11, False), (b, 12, False)][i]

    rows.update(np.array([3, 1]), np.array([100, 101]), describe)
    assert calls == [0, 1]
    np.testing.assert_array_equal(rows.take_dirty(), [1, 3])
    np.testing.assert_array_equal(rows.params[3], pack_params([a])[0])
    assert rows.seeds[1] == 12 and rows.owners[3] == 100
    calls.clear()
    rows.update(np.array([3, 1]), np.array([100, 101]), describe)  # steady step: nothing repacked
    assert calls == [] and rows.take_dirty().size == 0
    rows.update(np.array([1, 3]), np.array([101, 102]), lambda i: (b, 13, False))  # row 3 now holds seq 102
    np.testing.assert_array_equal(rows.take_dirty(), [3])
    assert rows.seeds[3] == 13 and rows.owners[3] == 102


def test_rows_grow_and_keep_what_they_held():
    rows = SamplingRows(num_rows=2)
    p = SamplingParams(temperature=0.9)
    rows.update(np.array([0]), np.array([5]), lambda i: (p, 7, False))
    rows.update(np.array([9]), np.array([6]), lambda i: (p, 8, False))
    assert rows.num_rows >= 10
    assert rows.owners[0] == 5 and rows.seeds[0] == 7 and rows.seeds[9] == 8
    assert rows.owners[1] == -1


def test_graph_ready_follows_samplable_and_min_tokens():
    rows = SamplingRows(eos_token_ids=(2,), num_rows=4)
    table = [(SamplingParams(min_tokens=3), 1, False), (SamplingParams(), 2, False),
             (SamplingParams(logprobs=1), 3, False)]
    rows.update(np.array([0, 1, 2]), np.array([10, 11, 12]), _describer(table))
    assert not rows.graph_ready(np.array([0, 1]), np.array([2, 9]))  # row 0 still under min_tokens
    assert rows.graph_ready(np.array([0, 1]), np.array([3, 9]))
    assert not rows.graph_ready(np.array([1, 2]), np.array([5, 5]))  # logprobs: eager


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), min_size=1, max_size=40))
def test_every_row_holds_the_params_of_its_last_sequence(steps):
    """Random (row, seq id) assignments: a row always holds the packing of the sequence last seen in it,
    and the dirty rows are exactly those whose sequence changed."""
    rows = SamplingRows(num_rows=2)
    params_of = {s: SamplingParams(temperature=0.1 * (s + 1), top_k=s) for s in range(7)}
    holder = {}
    for row, seq in steps:
        rows.update(np.array([row]), np.array([seq]), lambda i: (params_of[seq], 1000 + seq, False))
        dirty = rows.take_dirty().tolist()
        assert dirty == ([] if holder.get(row) == seq else [row])
        holder[row] = seq
    for row, seq in holder.items():
        np.testing.assert_array_equal(rows.params[row], pack_params([params_of[seq]])[0])
        assert rows.seeds[row] == 1000 + seq
