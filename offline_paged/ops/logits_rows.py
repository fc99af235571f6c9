"""The row counts the eager LM head GEMM runs on (CudaOps.logits): few shapes, so that cuBLAS has loaded every
kernel they need at engine start (CudaOps.warm_logits) and never blocks the host inside a run. Plain Python,
so the CPU tests it.
"""
from __future__ import annotations

LOGITS_MIN_ROWS = 8  # the LM head runs on 8, 16, 32, ... 256 rows, then on multiples of 256
LOGITS_ROW_STEP = 256  # (up to 256 rows it reads its weights once whatever the rows: padding costs ~nothing)


def logits_rows(num_rows: int) -> int:
    """The rows the LM head GEMM runs on for num_rows wanted: the next power of two from LOGITS_MIN_ROWS up to
    LOGITS_ROW_STEP, then the next multiple of LOGITS_ROW_STEP (num_rows 0 stays 0)."""
    if num_rows <= 0:
        return 0
    if num_rows > LOGITS_ROW_STEP:
        return -(-num_rows // LOGITS_ROW_STEP) * LOGITS_ROW_STEP
    return max(LOGITS_MIN_ROWS, 1 << (num_rows - 1).bit_length())


def logits_buckets(max_rows: int) -> list[int]:
    """Every value logits_rows takes for 1..max_rows rows, ascending."""
    buckets, rows = [], 1
    while rows <= max_rows:
        buckets.append(logits_rows(rows))
        rows = buckets[-1] + 1
    return buckets
