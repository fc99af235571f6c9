"""row_buckets: the power-of-two buckets the eager FP8 products are tuned at (CudaOps.warm_fp8_products)."""
from __future__ import annotations

import pytest

from offline_paged.ops.row_buckets import bucket_rows, row_bucket


@pytest.mark.parametrize("num_rows, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (2048, 2048),
                                              (2049, 4096), (7554, 8192), (8192, 8192), (8193, 16384)])
def test_row_bucket_is_the_power_of_two_at_or_above(num_rows, bucket):
    assert row_bucket(num_rows) == bucket


def test_row_bucket_refuses_negative_rows():
    with pytest.raises(ValueError, match="num_rows must be >= 0"):
        row_bucket(-1)


@pytest.mark.parametrize("min_rows, max_rows, rows", [
    (2049, 8192, [4096, 8192]),  # above the largest mixed-step graph (2048 tokens), an 8192-token budget
    (2049, 10000, [4096, 8192, 10000]),  # the last bucket tuned at the budget itself
    (1, 16, [1, 2, 4, 8, 16]),
    (0, 5, [1, 2, 4, 5]),
    (3000, 3000, [3000]),
    (2049, 2048, []),  # the mixed graphs take every step: nothing runs eagerly
])
def test_bucket_rows_tunes_each_bucket_a_step_can_fall_in(min_rows, max_rows, rows):
    assert bucket_rows(min_rows, max_rows) == rows


@pytest.mark.parametrize("min_rows, max_rows", [(1, 1), (2049, 8192), (5, 1000), (700, 9000), (1, 12345)])
def test_every_row_count_in_range_has_its_bucket_tuned(min_rows, max_rows):
    """Each count in [min_rows, max_rows] shares a bucket with exactly one tuned count."""
    tuned = bucket_rows(min_rows, max_rows)
    assert len({row_bucket(r) for r in tuned}) == len(tuned)
    assert all(min_rows <= r <= max_rows for r in tuned)
    for count in range(min_rows, max_rows + 1):
        assert sum(row_bucket(r) == row_bucket(count) for r in tuned) == 1, count
