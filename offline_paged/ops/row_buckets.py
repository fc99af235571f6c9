"""Power-of-two row buckets of the eager FP8 products: a plan tuned at a bucket's rows lends its algorithm to
every later plan of the same shape whose rows fall in that bucket (ops/cublaslt.py, CudaOps.warm_fp8_products).
Plain Python, so the CPU tests cover it."""
from __future__ import annotations


def row_bucket(num_rows: int) -> int:
    """The power of two at or above `num_rows` (1 for 0 or 1 rows)."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return 1 << max(num_rows - 1, 0).bit_length()


def bucket_rows(min_rows: int, max_rows: int) -> list[int]:
    """The row counts to tune so that every count in [min_rows, max_rows] has its bucket tuned: each bucket from
    min_rows' to max_rows', the last one at max_rows itself (no step runs more). [] when min_rows > max_rows."""
    rows, bucket = [], row_bucket(max(min_rows, 1))
    while min_rows <= max_rows and bucket < 2 * max_rows:
        rows.append(min(bucket, max_rows))
        bucket *= 2
    return rows
