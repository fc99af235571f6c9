"""StepRows: a BlockTableRows that GPU tests fill with one decode step's block tables at a time (fresh seq ids
each step, the previous step's released), as the runner does, for DecodeGraphs.run's persistent rows."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from offline_paged.worker.block_table_rows import BlockTableRows


class StepRows:
    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.table_rows = BlockTableRows(block_size, max_blocks=max_blocks, num_rows=4)  # grows: realloc path
        self.table_rows.track_changes = True
        self._seq_ids: list[int] = []
        self._next = 0

    def step(self, tables, positions, seq_ids=None) -> np.ndarray:
        """Rows [S] of the step's sequences: table i computes position positions[i]. seq_ids: keep these
        sequences (and their rows) from earlier steps; None: all new."""
        if seq_ids is None:
            seq_ids = list(range(self._next, self._next + len(tables)))
        self._next = max([self._next, *[s + 1 for s in seq_ids]])
        self.table_rows.release([s for s in self._seq_ids if s not in seq_ids])
        self._seq_ids = list(seq_ids)
        items = [SimpleNamespace(seq=SimpleNamespace(seq_id=s), block_table=list(t), start=int(p), num_new_tokens=1)
                 for s, t, p in zip(self._seq_ids, tables, positions)]
        return self.table_rows.sync(items)
