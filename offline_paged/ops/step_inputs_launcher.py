"""Thin typed launchers for cuda/step_inputs.cu: the decode graphs' inputs built on the device from the
persistent block-table rows. Each checks dtypes, contiguity and shapes, raises ValueError saying what is
wrong, and launches on the current CuPy stream without synchronising.

Legend: R persistent rows, Mr their width, b bucket slots, M the bucket's table width, n changed entries.
"""
from __future__ import annotations

import numpy as np

from offline_paged.ops.kernel_modules import kernel
from offline_paged.ops.sampling_launcher import _check

SOURCE = "step_inputs.cu"
# Every (source, entry point) launched here (checked against the compiled source by tests/test_cuda_compile.py).
KERNELS = (("step_inputs.cu", "scatter_table_entries"), ("step_inputs.cu", "decode_inputs"),
           ("step_inputs.cu", "launch_order"))


def _kernel(filename: str, name: str):
    if (filename, name) not in KERNELS:
        raise RuntimeError(f"{filename}:{name} is not declared in step_inputs_launcher.KERNELS")
    return kernel(filename, name)


def scatter_table_entries(changes, row_tables) -> None:
    """row_tables[row, column] = block for each (row, column, block) of changes [n, 3] int32."""
    _check("changes", changes, np.int32, (None, 3))
    _check("row_tables", row_tables, np.int32, (None, None))
    num_changes = changes.shape[0]
    if num_changes:
        _kernel(SOURCE, "scatter_table_entries")((-(-num_changes // 256),), (256,), (
            changes, row_tables, np.int32(num_changes), np.int32(row_tables.shape[1])))


def decode_inputs(slot_rows, positions, writes, row_tables, slot_mapping, context_lens, query_start_loc,
                  block_tables, block_size: int) -> None:
    """A decode bucket's slot mapping [b], context lens [b], query_start_loc [b + 1] and block tables [b, M]
    from each slot's persistent row (-1: padding), position and write flag (see step_inputs.cu)."""
    _check("slot_rows", slot_rows, np.int32, (None,))
    num_slots = slot_rows.shape[0]
    for name, a in (("positions", positions), ("writes", writes), ("slot_mapping", slot_mapping),
                    ("context_lens", context_lens)):
        _check(name, a, np.int32, (num_slots,))
    _check("query_start_loc", query_start_loc, np.int32, (num_slots + 1,))
    _check("row_tables", row_tables, np.int32, (None, None))
    _check("block_tables", block_tables, np.int32, (num_slots, None))
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_slots:
        _kernel(SOURCE, "decode_inputs")((num_slots,), (128,), (
            slot_rows, positions, writes, row_tables, np.int32(row_tables.shape[1]), slot_mapping, context_lens,
            query_start_loc, block_tables, np.int32(block_tables.shape[1]), np.int32(block_size),
            np.int32(num_slots)))


def launch_order(context_lens, order) -> None:
    """order [n] int32 (out): the sequences' indices by context_lens [n] int32, longest first, ties in
    index order (the attention kernel's launch order; see step_inputs.cu)."""
    _check("context_lens", context_lens, np.int32, (None,))
    num_seqs = context_lens.shape[0]
    _check("order", order, np.int32, (num_seqs,))
    if num_seqs:
        _kernel(SOURCE, "launch_order")((-(-num_seqs // 256),), (256,), (context_lens, order, np.int32(num_seqs)))
