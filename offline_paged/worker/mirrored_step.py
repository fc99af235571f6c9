"""MirroredStep: what tensor-parallel rank 0's runner hands its mirror each step, and what the runners of the
other ranks replay (`ModelRunner.run_mirrored`), so that every rank moves the same blocks and runs the same
forward (its collectives pair up). Value objects only; offline_paged/tp/ carries them over the pipes.

Legend: S scheduled sequences, M max blocks per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from offline_paged.worker.step_inputs import EagerLayout


@dataclass(slots=True, frozen=True)
class BlockMoves:
    """A step's block moves, in the order they run: swap-outs, swap-ins, copy-on-write copies."""

    swap_out: list[tuple[int, int]]  # (device block, CPU block)
    swap_in: list[tuple[int, int]]  # (CPU block, device block)
    copies: list[tuple[int, int]]  # (source device block, destination device block)

    @classmethod
    def of(cls, output) -> BlockMoves:
        """The moves a SchedulerOutput asks for."""
        return cls(output.blocks_to_swap_out, output.blocks_to_swap_in, output.blocks_to_copy)


@dataclass(slots=True, frozen=True)
class RowsDiff:
    """Rank 0's BlockTableRows since the last step: the table's shape and the entries written
    (BlockTableRows.take_mirror_changes); a rank's MirroredRows applies it."""

    table_shape: tuple[int, int]  # [R, M]
    changes: np.ndarray  # [n, 3] int32 (row, column, block id)


@dataclass(slots=True, frozen=True)
class EagerForward:
    """An eager forward's inputs: rank 0's packed array without its block tables (each rank rebuilds
    them from its MirroredRows), how it splits, and the sequences' rows and row lengths."""

    inputs_head: np.ndarray  # [sum of part sizes - layout.num_table_entries] int32
    layout: EagerLayout
    rows: np.ndarray  # [S] block-table rows
    row_lens: np.ndarray  # [S] entries in each row


@dataclass(slots=True, frozen=True)
class GraphForward:
    """A decode-only step replayed from the CUDA graph of the same bucket on every rank."""

    input_ids: np.ndarray  # [S] int64, 0 where pending
    positions: np.ndarray  # [S] int64
    writes: np.ndarray  # [S] bool
    rows: np.ndarray  # [S] block-table rows


@dataclass(slots=True, frozen=True)
class MirroredStep:
    """One launched step as the other ranks replay it. forward: None when no sequence runs."""

    moves: BlockMoves
    rows_diff: RowsDiff
    forward: EagerForward | GraphForward | None
