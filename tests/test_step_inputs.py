"""step_inputs: the synthetic memory-profiling step and the decode-graph fields (CPU)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from offline_paged.worker.step_inputs import decode_fields, synthetic_prefill


@pytest.mark.parametrize("num_tokens, num_seqs, block_size", [(100, 7, 16), (5, 9, 4), (64, 1, 16), (33, 4, 8)])
def test_synthetic_prefill_puts_every_token_in_its_own_slot_of_its_own_blocks(num_tokens, num_seqs, block_size):
    step = synthetic_prefill(num_tokens, num_seqs, block_size)
    lens, tables, slots = step["lens"], step["tables"], step["slots"]
    assert lens.sum() == num_tokens and lens.max() - lens.min() <= 1
    assert len(set(slots.tolist())) == num_tokens  # no two tokens share a slot
    assert step["num_blocks"] == int((-(-lens // block_size)).sum())
    owner = np.repeat(np.arange(lens.size), lens)
    for t in range(num_tokens):
        position = step["positions"][t]
        assert 0 <= position < lens[owner[t]]
        assert slots[t] == tables[owner[t], position // block_size] * block_size + position % block_size
        assert slots[t] < step["num_blocks"] * block_size
    np.testing.assert_array_equal(step["query_start_loc"], np.concatenate([[0], np.cumsum(lens)]))


def test_decode_fields_flag_cached_tokens_and_leave_pending_ids_zero():
    def item(token_ids, start, skip):
        return SimpleNamespace(seq=SimpleNamespace(token_ids=token_ids), start=start, num_skip_write=skip)

    positions, ids, writes = decode_fields([item([5, 6, 7], 2, 0), item([8, 9], 2, 0), item([1, 2, 3, 4], 1, 3)])
    assert positions.tolist() == [2, 2, 1]
    assert ids.tolist() == [7, 0, 2]  # the second one's token is still pending: filled on the device
    assert writes.tolist() == [True, True, False]
