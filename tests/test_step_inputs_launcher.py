"""The decode-input kernels (ops/step_inputs_launcher.py) against NumPy: table scatters, slot mapping,
context lens, query_start_loc and bucket tables. Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from offline_paged.ops import step_inputs_launcher  # noqa: E402


def test_decode_inputs_kernel_matches_numpy():
    """Slot mapping, context lens, query_start_loc and bucket tables from persistent rows, with padding
    slots, a no-write slot, rows wider and narrower than the bucket, and scattered table changes."""
    rng = np.random.default_rng(4)
    block_size, num_rows, row_width, width, b = 16, 9, 12, 10, 8
    row_tables = rng.integers(0, 5000, (num_rows, row_width)).astype(np.int32)  # [R, Mr]
    changes = np.array([[2, 0, 77], [5, 3, 88], [2, 1, 99]], dtype=np.int32)  # (row, column, block)
    device_rows = cupy.asarray(row_tables)
    step_inputs_launcher.scatter_table_entries(cupy.asarray(changes), device_rows)
    row_tables[changes[:, 0], changes[:, 1]] = changes[:, 2]
    np.testing.assert_array_equal(device_rows.get(), row_tables)
    slot_rows = np.array([2, 5, 0, 8, 3, -1, -1, -1], dtype=np.int32)  # [b]
    positions = np.array([17, 50, 0, 159, 31, 0, 0, 0], dtype=np.int32)  # [b]
    writes = np.array([1, 0, 1, 1, 1, 0, 0, 0], dtype=np.int32)  # [b]
    outs = [cupy.full(n, -7, dtype=cupy.int32) for n in (b, b, b + 1)] + [cupy.full((b, width), -7, dtype=cupy.int32)]
    step_inputs_launcher.decode_inputs(cupy.asarray(slot_rows), cupy.asarray(positions), cupy.asarray(writes),
                                       device_rows, *outs, block_size)
    slots, ctx, qsl, tables = (o.get() for o in outs)
    real = slot_rows >= 0
    blocks = row_tables[slot_rows[real], positions[real] // block_size]
    expected_slots = np.full(b, -1)
    expected_slots[real] = np.where(writes[real] == 1, blocks * block_size + positions[real] % block_size, -1)
    np.testing.assert_array_equal(slots, expected_slots)
    np.testing.assert_array_equal(ctx, positions + 1)
    np.testing.assert_array_equal(qsl, np.arange(b + 1))
    for i in range(b):
        used = min(int(positions[i]) // block_size + 1, width) if real[i] else 0
        np.testing.assert_array_equal(tables[i, :used], row_tables[slot_rows[i], :used])
        assert not tables[i, used:].any()


@pytest.mark.parametrize("num_seqs", [1, 7, 256, 257, 600])
def test_launch_order_is_longest_first_with_ties_in_index_order(num_seqs):
    """The attention launch order: a stable sort by context length, descending, over several 256-wide tiles,
    with many ties (lengths drawn from a small range) and padding-like length-1 slots."""
    rng = np.random.default_rng(num_seqs)
    lens = rng.integers(1, 40, num_seqs).astype(np.int32)  # [n]
    lens[rng.random(num_seqs) < 0.2] = 1
    order = cupy.full(num_seqs, -1, dtype=cupy.int32)
    step_inputs_launcher.launch_order(cupy.asarray(lens), order)
    np.testing.assert_array_equal(order.get(), np.argsort(-lens, kind="stable"))


def test_launch_order_says_what_is_wrong():
    with pytest.raises(ValueError, match="order"):
        step_inputs_launcher.launch_order(cupy.zeros(4, dtype=cupy.int32), cupy.zeros(3, dtype=cupy.int32))
    with pytest.raises(ValueError, match="context_lens"):
        step_inputs_launcher.launch_order(cupy.zeros(4, dtype=cupy.int64), cupy.zeros(4, dtype=cupy.int32))
