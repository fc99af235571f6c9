"""The sizes CUDA graphs are captured for, and the bucket a step replays: decode graphs by batch size
(cuda_graph_runner.py), mixed-step graphs by token count (mixed_graphs.py). Plain Python, so the CPU tests it."""
from __future__ import annotations

# Batch sizes, to 1,024 sequences (vLLM's H100 default): a decode step larger than the last bucket replays the
# piecewise mixed-step graphs instead, ~4x the host launch time (3.58 against 0.89 ms at 1B, session 44).
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, *range(64, 257, 16), *range(288, 513, 32), *range(576, 1025, 64))
# Token counts of steps that prefill. Once a step's GEMMs are bound by their FLOPs (~150 rows at 1B), padding rows
# cost as much as real ones: the steps keep the padding within 16 rows or a quarter of the step, and 128 rows.
MIXED_BUCKETS = (*range(16, 129, 16), *range(160, 257, 32), *range(320, 513, 64), *range(640, 8193, 128))


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The bucket sizes worth capturing for batches of up to max_num_seqs sequences: DECODE_BUCKETS up to the
    first that holds max_num_seqs. Fine steps above 64 keep the padding (whose GEMM rows, LM head rows and
    sampled rows cost as much as real ones) below 16 rows up to 256 sequences."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return _up_to(DECODE_BUCKETS, max_num_seqs)


def mixed_buckets(max_tokens: int) -> tuple[int, ...]:
    """The bucket sizes worth capturing for prefilling steps of up to max_tokens tokens: MIXED_BUCKETS up to the
    first that holds max_tokens. 0 (mixed-step graphs off): none."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (0: no mixed-step graphs), got {max_tokens}")
    return _up_to(MIXED_BUCKETS, max_tokens) if max_tokens else ()


def bucket_for(buckets: tuple[int, ...], size: int) -> int | None:
    """The smallest of the sorted `buckets` that holds `size` (> 0), or None when none does."""
    if size < 1 or not buckets or size > buckets[-1]:
        return None
    return next(b for b in buckets if b >= size)


def _up_to(buckets: tuple[int, ...], size: int) -> tuple[int, ...]:
    if size >= buckets[-1]:
        return buckets
    return tuple(b for b in buckets if b < size) + (next(b for b in buckets if b >= size),)
