"""BlockTableRows' change feed: a mirror that applies take_changes() (and copies whole on a new generation)
always equals the host rows on every synced entry (what the decode graphs' device tables rely on)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings, strategies as st

from offline_paged.worker.block_table_rows import BlockTableRows, MirroredRows

BLOCK = 4


def _item(seq_id, table, start, num_new=1):
    return SimpleNamespace(seq=SimpleNamespace(seq_id=seq_id), block_table=table, start=start, num_new_tokens=num_new)


def _step(rows: BlockTableRows, tables: dict[int, list[int]], op: str, seq: int, value: int):
    """One fuzz step on the block manager's side: release a sequence (None), or grow, copy-on-write or
    replace its table and sync every live one (each step writes its last block); the synced rows [S]."""
    if op == "release":
        rows.release([seq])
        tables.pop(seq, None)
        return None
    table = tables.setdefault(seq, [value])
    if op == "grow":
        table.append(value)
    elif op == "cow":
        table[-1] = value + 1
    else:
        tables[seq] = [value, value + 2]
    return rows.sync([_item(s, t, (len(t) - 1) * BLOCK) for s, t in tables.items()])  # [S]


class Mirror:
    def __init__(self) -> None:
        self.tables, self.generation = None, None

    def sync(self, rows: BlockTableRows) -> None:
        changes = rows.take_changes()
        if self.generation != rows.generation:
            self.tables, self.generation = rows.tables.copy(), rows.generation
            return
        self.tables[changes[:, 0], changes[:, 1]] = changes[:, 2]


def test_a_steady_decode_step_reports_only_new_and_replaced_blocks():
    rows = BlockTableRows(BLOCK, max_blocks=8, num_rows=4)
    rows.track_changes = True
    a, b = [5, 6], [7]
    rows.sync([_item(1, a, 5), _item(2, b, 2)])
    assert sorted(map(tuple, rows.take_changes().tolist())) == [(0, 0, 5), (0, 1, 6), (1, 0, 7)]
    rows.sync([_item(1, a, 6), _item(2, b, 3)])  # nothing new
    assert rows.take_changes().shape == (0, 3)
    a.append(9)
    b[0] = 11  # copy-on-write of the block seq 2 writes
    rows.sync([_item(1, a, 8), _item(2, b, 3)])
    assert sorted(map(tuple, rows.take_changes().tolist())) == [(0, 2, 9), (1, 0, 11)]


def test_no_change_feed_unless_asked():
    rows = BlockTableRows(BLOCK, max_blocks=8, num_rows=4)
    rows.sync([_item(1, [5, 6], 5)])
    assert rows.take_changes().shape == (0, 3)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "cow", "new", "release"]), st.integers(0, 5),
                          st.integers(0, 1000)), min_size=1, max_size=60))
def test_mirror_follows_the_rows(ops):
    rows = BlockTableRows(BLOCK, max_blocks=2, num_rows=2)  # tiny: widening and growth are exercised
    rows.track_changes = True
    mirror = Mirror()
    tables: dict[int, list[int]] = {}
    for op, seq, value in ops:
        synced = _step(rows, tables, op, seq, value)
        if synced is None:
            continue
        mirror.sync(rows)
        for row, (s, t) in zip(synced.tolist(), tables.items()):
            assert mirror.tables[row, :len(t)].tolist() == t, (s, t)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "cow", "new", "release"]), st.integers(0, 5),
                          st.integers(0, 1000)), min_size=1, max_size=60),
       st.booleans())
def test_tensor_parallel_rows_follow_by_diffs(ops, graphs_too):
    """A rank > 0's MirroredRows, fed only each step's shape and take_mirror_changes(), gives the same
    padded block tables as rank 0 and a device-feed identical to what rank 0's graphs would apply; the
    graphs' own feed (take_changes) is independent of the mirror feed."""
    rows = BlockTableRows(BLOCK, max_blocks=2, num_rows=2)
    rows.track_changes = graphs_too  # rank 0's decode graphs take their feed too
    rows.track_mirror = True
    other = MirroredRows(BLOCK)
    other.track_changes = True
    device = Mirror()  # rank 1's decode graphs, fed by other.take_changes()
    tables: dict[int, list[int]] = {}
    for op, seq, value in ops:
        synced = _step(rows, tables, op, seq, value)
        if synced is None:
            continue
        if graphs_too:
            rows.take_changes()  # rank 0's graphs consume their feed; the mirror feed must not care
        other.apply(rows.tables.shape, rows.take_mirror_changes())
        device.sync(other)
        lens = rows.lens[synced]
        width = int(lens.max())
        np.testing.assert_array_equal(other.block_tables(synced, lens, width), rows.tables[synced, :width])
        for row, t in zip(synced.tolist(), tables.values()):
            assert device.tables[row, :len(t)].tolist() == t
