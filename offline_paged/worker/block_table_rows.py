"""BlockTableRows: the running sequences' block tables as rows of one host array that lives across steps.

Data structure: `tables` [R, M] int32 (R rows and M columns, each grown by doubling as needed), a
dict seq id -> row, per row the number of entries already copied (a Python list: a sync reads and writes
it per sequence, which costs a fraction of numpy scalar access; `lens` is its array copy) and the
identity of the block manager's list they came from, and a stack of free rows. A step syncs each
scheduled sequence's row with O(changes) work: the entries appended since the last step, plus the
blocks this step writes (the only ones a copy-on-write can have replaced). A sequence whose blocks were
freed (finished, preempted, swapped out, parked) is released by id (`SchedulerOutput.freed_seq_ids`);
its next schedule starts a fresh row. A table list that is not the one a row was synced from is copied whole.
Padding entries are 0.

Step inputs then come from numpy fancy indexing of `tables` (one C-level gather per step) instead of
walking every table in Python. A device mirror (the decode graphs' block tables) is kept in step by
`take_changes()`: the (row, column, value) entries that changed since the last call, so a steady decode
step uploads only the block ids that are new (one per sequence every block_size steps) or replaced by
copy-on-write (recorded only when `track_changes` is set). `generation` counts reallocations (more
rows or columns): a mirror of another generation must copy `tables` whole. Entries past a row's
length are not reported (nothing reads them).
"""
from __future__ import annotations

import numpy as np


class BlockTableRows:
    def __init__(self, block_size: int, max_blocks: int = 64, num_rows: int = 64) -> None:
        self.block_size = block_size
        self.tables = np.zeros((num_rows, max_blocks), dtype=np.int32)  # [R, M]
        self._lens = [0] * num_rows  # entries synced per row
        self._sources: list[object] = [None] * num_rows  # the list each row was synced from
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._changed: list[tuple[int, int, int]] = []  # (row, first column, end column) written since take
        self.track_changes = False  # only a device mirror needs the change feed
        self._mirror_changed: list[tuple[int, int, int]] = []  # the same, for the tensor-parallel ranks
        self.track_mirror = False  # set on rank 0 of a tensor-parallel group
        self.generation = 0

    @property
    def num_rows_used(self) -> int:
        return len(self._row_of)

    @property
    def lens(self) -> np.ndarray:
        """[R] int64 entries synced per row (a copy: a row's length changes only through sync and release)."""
        return np.array(self._lens, dtype=np.int64)

    def release(self, seq_ids) -> None:
        """Forget the rows of sequences whose blocks were freed (unknown ids are ignored)."""
        for seq_id in seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is not None:
                self._lens[row] = 0
                self._sources[row] = None
                self._free_rows.append(row)

    def sync(self, scheduled) -> np.ndarray:
        """Bring the rows of a step's ScheduledSequences up to date; returns their rows [S] int64."""
        rows = [self._sync_one(item.seq.seq_id, item.block_table, item.start, item.num_new_tokens)
                for item in scheduled]
        return np.array(rows, dtype=np.int64)  # [S]

    def _sync_one(self, seq_id: int, table: list[int], start: int, num_new: int) -> int:
        row = self._row_of.get(seq_id)
        if row is None:
            row = self._take_row(seq_id)
        num_entries, synced = len(table), self._lens[row]
        if self._sources[row] is not table or num_entries < synced:
            synced = self._lens[row] = 0  # another list (or a shorter one): copy it whole
            self._sources[row] = table
            self._widen(num_entries)
            self.tables[row, num_entries:] = 0
        # The blocks this step writes may have been replaced by copy-on-write since the last sync (item(): a
        # Python int, no numpy scalar). A decode writes one block: the loop's range, without building one.
        bs = self.block_size
        if num_new == 1:
            col = start // bs
            if col < synced and self.tables.item(row, col) != table[col]:
                self.tables[row, col] = table[col]
                self._record(row, col, col + 1)
        else:
            for col in range(min(start // bs, synced), min((start + max(num_new, 1) - 1) // bs + 1, synced)):
                if self.tables.item(row, col) != table[col]:
                    self.tables[row, col] = table[col]
                    self._record(row, col, col + 1)
        if num_entries > synced:
            self._widen(num_entries)
            self.tables[row, synced:num_entries] = table[synced:num_entries]
            self._record(row, synced, num_entries)
            self._lens[row] = num_entries
        return row

    def _record(self, row: int, first: int, end: int) -> None:
        if self.track_changes:
            self._changed.append((row, first, end))
        if self.track_mirror:
            self._mirror_changed.append((row, first, end))

    def take_changes(self) -> np.ndarray:
        """[n, 3] int32 (row, column, block id) of the entries written since the last call (then forgotten);
        the values are the current ones."""
        return self._entries(self._changed)

    def take_mirror_changes(self) -> np.ndarray:
        """`take_changes` for the tensor-parallel ranks: an independent feed (the decode graphs take theirs)."""
        return self._entries(self._mirror_changed)

    def _entries(self, changed: list[tuple[int, int, int]]) -> np.ndarray:
        if not changed:
            return np.zeros((0, 3), dtype=np.int32)
        spans = np.array(changed, dtype=np.int64)  # [k, 3] (row, first column, end column)
        changed.clear()
        widths = spans[:, 2] - spans[:, 1]  # [k]
        rows = np.repeat(spans[:, 0], widths)  # [n]
        firsts = np.repeat(spans[:, 1] - (np.cumsum(widths) - widths), widths)  # [n]
        cols = np.arange(int(widths.sum())) + firsts  # [n]
        return np.stack([rows, cols, self.tables[rows, cols]], axis=1).astype(np.int32)  # [n, 3]

    def _take_row(self, seq_id: int) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def _grow(self) -> None:
        old = self.tables.shape[0]
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])  # [2R, M]
        self._lens += [0] * old
        self._sources += [None] * old
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
        self.generation += 1

    def _widen(self, num_entries: int) -> None:
        """Make room for rows of `num_entries` entries (nothing to do when they fit)."""
        if num_entries <= self.tables.shape[1]:
            return
        width = max(num_entries, 2 * self.tables.shape[1])
        wider = np.zeros((self.tables.shape[0], width), dtype=np.int32)  # [R, M']
        wider[:, :self.tables.shape[1]] = self.tables
        self.tables = wider
        self.generation += 1


class MirroredRows:
    """A tensor-parallel rank's copy of rank 0's BlockTableRows, kept by its diffs: each step rank 0 sends
    the table's shape and the entries written since the last step (`take_mirror_changes`), nothing else.
    Serves the decode graphs as BlockTableRows does (tables, generation, take_changes) and the eager
    step's block tables (`block_tables`). Entries past a row's length may be stale; no reader uses them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tables = np.zeros((0, 0), dtype=np.int32)  # [R, M]
        self.generation = 0
        self.track_changes = False  # set when this rank's decode graphs mirror the rows on the device
        self._pending: list[np.ndarray] = []  # applied changes the decode graphs have not taken yet

    def apply(self, shape: tuple[int, int], changes: np.ndarray) -> None:
        """Rank 0's table is `shape` now and `changes` [n, 3] (row, column, block id) were written."""
        if tuple(shape) != self.tables.shape:
            grown = np.zeros(shape, dtype=np.int32)
            rows, cols = min(shape[0], self.tables.shape[0]), min(shape[1], self.tables.shape[1])
            grown[:rows, :cols] = self.tables[:rows, :cols]
            self.tables = grown
            self.generation += 1
        if changes.size:
            self.tables[changes[:, 0], changes[:, 1]] = changes[:, 2]
            if self.track_changes:
                self._pending.append(changes)

    def take_changes(self) -> np.ndarray:
        if not self._pending:
            return np.zeros((0, 3), dtype=np.int32)
        changes = np.concatenate(self._pending)  # [n, 3], applied in order (a later entry wins)
        self._pending.clear()
        rows, cols = changes[:, 0], changes[:, 1]
        return np.stack([rows, cols, self.tables[rows, cols]], axis=1).astype(np.int32)  # current values

    def block_tables(self, rows: np.ndarray, lens: np.ndarray, width: int) -> np.ndarray:
        """[S, width] int32: the rows' tables, zero past each row's length (as BlockTableRows pads)."""
        tables = self.tables[rows, :width].copy()  # [S, width]
        tables[np.arange(width)[None, :] >= lens[:, None]] = 0
        return tables
