"""BlockTableRows.sync as a state machine against a plain-Python model: after every sync, each
scheduled row equals its block table (padding 0), through appends, copy-on-write of the blocks a step
writes, whole-list swaps, releases, and growth of the array in both directions."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offline_paged.worker.block_table_rows import BlockTableRows

BLOCK_SIZE = 4


def _scheduled(seq_id: int, table: list[int], start: int, num_new: int):
    return SimpleNamespace(seq=SimpleNamespace(seq_id=seq_id), block_table=table, start=start,
                           num_new_tokens=num_new)


class BlockTableRowsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rows = BlockTableRows(BLOCK_SIZE, max_blocks=2, num_rows=2)  # tiny: growth is exercised
        self.tables: dict[int, list[int]] = {}  # seq id -> its block manager list
        self.num_tokens: dict[int, int] = {}
        self.last_rows: dict[int, int] = {}
        self.block_ids = itertools.count(1)
        self.seq_ids = itertools.count()

    def _step_item(self, seq_id: int, num_new: int, copy_on_write: bool):
        table, start = self.tables[seq_id], self.num_tokens[seq_id]
        while len(table) * BLOCK_SIZE < start + num_new:
            table.append(next(self.block_ids))
        if copy_on_write:
            table[start // BLOCK_SIZE] = next(self.block_ids)  # in place: the block this step writes
        self.num_tokens[seq_id] = start + num_new
        return _scheduled(seq_id, table, start, num_new)

    @rule(num_prompt=st.integers(1, 20))
    def admit(self, num_prompt):
        seq_id = next(self.seq_ids)
        self.tables[seq_id], self.num_tokens[seq_id] = [], 0
        self._sync([self._step_item(seq_id, num_prompt, False)])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def step(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.tables)), min_size=1, unique=True))
        items = [self._step_item(seq_id, data.draw(st.integers(1, 6)), data.draw(st.booleans()))
                 for seq_id in chosen]
        self._sync(items)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def swap_in_a_new_list(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tables)))
        size = data.draw(st.integers(1, 2 * len(self.tables[seq_id]) + 1))
        self.tables[seq_id] = [next(self.block_ids) for _ in range(size)]
        self.num_tokens[seq_id] = (size - 1) * BLOCK_SIZE
        self._sync([self._step_item(seq_id, 1, False)])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tables)))
        del self.tables[seq_id], self.num_tokens[seq_id]
        self.last_rows.pop(seq_id, None)
        self.rows.release([seq_id, -1])  # an unknown id is ignored

    def _sync(self, items):
        rows = self.rows.sync(items)
        assert rows.shape == (len(items),) and len(set(rows.tolist())) == len(items)
        for item, row in zip(items, rows.tolist()):
            self.last_rows[item.seq.seq_id] = row
            table = self.tables[item.seq.seq_id]
            assert self.rows.tables[row, :len(table)].tolist() == table
            assert not self.rows.tables[row, len(table):].any(), "padding must be 0"

    @invariant()
    def one_row_per_live_sequence(self):
        assert self.rows.num_rows_used == len(self.tables)

    @invariant()
    def every_known_row_still_holds_its_table(self):
        for seq_id, row in self.last_rows.items():
            table = self.tables[seq_id]
            assert self.rows.tables[row, :len(table)].tolist() == table


# 150 runs of 30 steps under the ci profile; the fuzz profile (conftest) scales both
BlockTableRowsMachine.TestCase.settings = settings(max_examples=3 * settings.default.max_examples // 2,
                                                  stateful_step_count=30 * settings.default.stateful_step_count // 500,
                                                  deadline=None)
TestBlockTableRows = BlockTableRowsMachine.TestCase


def test_a_row_freed_by_release_is_reused_and_starts_clean():
    rows = BlockTableRows(BLOCK_SIZE, max_blocks=4, num_rows=1)
    first = rows.sync([_scheduled(7, [5, 6, 7], 0, 12)])[0]
    rows.release([7])
    second = rows.sync([_scheduled(8, [9], 0, 3)])[0]
    assert second == first
    assert rows.tables[second].tolist() == [9, 0, 0, 0]


def test_entries_outside_the_written_blocks_are_not_recopied():
    """The O(changes) contract: an in-place change to a block the step does not write is not seen
    (the block manager only ever replaces blocks being written, by copy-on-write)."""
    rows = BlockTableRows(BLOCK_SIZE)
    table = [1, 2, 3]
    rows.sync([_scheduled(0, table, 0, 12)])
    table[0] = 99  # not written by the next step (it writes position 12, block 3)
    table.append(4)
    row = rows.sync([_scheduled(0, table, 12, 1)])[0]
    assert rows.tables[row, :4].tolist() == [1, 2, 3, 4]
    assert np.array_equal(rows.lens[row], 4)
