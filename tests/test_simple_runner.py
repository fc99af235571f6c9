"""SimpleRunner (models/simple_runner.py) on a recording fake model: slots follow the block tables, pools
run out loudly, freed blocks come back, logits rows are split per sequence, greedy follows argmax, and
build_metadata pads the block tables."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from offline_paged.models.simple_runner import SimpleRunner, build_metadata

V = 11


class FakeModel:
    """Logits of a row put the maximum on (input token + position + 1) % V; every call is recorded."""

    def __init__(self):
        self.ops = SimpleNamespace(xp=np)
        self.calls = []

    def allocate_kv_cache(self, num_blocks, block_size):
        return np.zeros((num_blocks, block_size))

    def forward(self, input_ids, positions, kv_cache, meta, logits_rows):
        self.calls.append((input_ids.copy(), positions.copy(), meta, logits_rows.copy()))
        logits = np.zeros((len(logits_rows), V), dtype=np.float32)
        logits[np.arange(len(logits_rows)), (input_ids[logits_rows] + positions[logits_rows] + 1) % V] = 1.0
        return logits


def test_slots_follow_each_sequences_block_table():
    rng = np.random.default_rng(41)
    model = FakeModel()
    runner = SimpleRunner(model, num_blocks=32, block_size=4, seed=3)
    prompts = {s: rng.integers(0, V, size=int(n)).tolist() for s, n in enumerate(rng.integers(1, 14, size=4))}
    runner.prefill(list(prompts.items()), chunk=5)
    runner.step([(s, [int(rng.integers(0, V))]) for s in prompts])
    for input_ids, positions, meta, _ in model.calls:
        starts = meta.query_start_loc
        for row, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            table = meta.block_tables[row]
            for pos, slot in zip(positions[lo:hi], meta.slot_mapping[lo:hi]):
                assert slot == table[pos // 4] * 4 + pos % 4
    tables = [runner.seqs[s].block_table for s in prompts]
    flat = [b for t in tables for b in t]
    assert len(flat) == len(set(flat))  # no block shared between sequences
    assert flat != sorted(flat)  # handed out shuffled: block tables are not contiguous
    for s, prompt in prompts.items():
        assert runner.seqs[s].num_cached == len(prompt) + 1
        assert len(runner.seqs[s].block_table) == -(-(len(prompt) + 1) // 4)


def test_exhausted_pool_is_an_error_and_freed_blocks_come_back():
    runner = SimpleRunner(FakeModel(), num_blocks=3, block_size=2)
    runner.step([(0, [1, 2, 3, 4])])
    with pytest.raises(RuntimeError, match=r"KV pool exhausted \(need 2 blocks, 1 free\)"):
        runner.step([(1, [1, 2, 3])])
    runner.free(0)
    assert sorted(runner.free_blocks) == [0, 1, 2]


def test_all_logits_rows_are_split_per_sequence():
    rng = np.random.default_rng(42)
    runner = SimpleRunner(FakeModel(), num_blocks=16, block_size=4)
    batch = [(0, rng.integers(0, V, size=5).tolist()), (1, rng.integers(0, V, size=2).tolist())]
    every = runner.step(batch, all_logits=True)
    assert [rows.shape for rows in every] == [(5, V), (2, V)]
    for (_, ids), rows in zip(batch, every):
        assert np.argmax(rows, axis=1).tolist() == [(t + p + 1) % V for p, t in enumerate(ids)]


def test_greedy_follows_argmax_and_frees_its_sequences():
    rng = np.random.default_rng(43)
    runner = SimpleRunner(FakeModel(), num_blocks=40, block_size=4)
    prompts = [rng.integers(0, V, size=int(n)).tolist() for n in (3, 7)]
    outs = runner.greedy(prompts, max_new_tokens=5, prefill_chunk=2)
    for prompt, out in zip(prompts, outs):
        tokens = list(prompt)
        for _ in range(5):
            tokens.append((tokens[-1] + len(tokens) - 1 + 1) % V)
        assert out == tokens[len(prompt):]
    assert runner.seqs == {} and len(runner.free_blocks) == 40


def test_build_metadata_pads_tables_and_counts():
    meta = build_metadata(np, [[5, 2, 7], [1]], [9, 3], [1, 3], [29, 30, 4, 5])
    assert meta.block_tables.tolist() == [[5, 2, 7], [1, 0, 0]]
    assert meta.query_start_loc.tolist() == [0, 1, 4]
    assert (meta.max_query_len, meta.max_context_len) == (3, 9)
    assert meta.slot_mapping.dtype == np.int32 and meta.context_lens.tolist() == [9, 3]
