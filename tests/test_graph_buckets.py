"""The CUDA graphs' bucket sizes and the bucket a step replays (worker/graph_buckets.py): plain Python."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from offline_paged.worker.graph_buckets import (DECODE_BUCKETS, MIXED_BUCKETS, bucket_for, decode_buckets,
                                                mixed_buckets)


def test_decode_buckets_end_at_the_first_bucket_holding_max_num_seqs():
    assert decode_buckets(256)[-1] == 256 and decode_buckets(256)[:5] == (1, 2, 4, 8, 16)
    assert decode_buckets(200)[-1] == 208 and max(decode_buckets(200)) == 208
    assert decode_buckets(1) == (1,) and decode_buckets(3) == (1, 2, 4)
    assert decode_buckets(10_000) == DECODE_BUCKETS
    steps = np.diff([b for b in DECODE_BUCKETS if 64 <= b <= 256])
    assert steps.max() == 16  # padding below 16 rows from 64 to 256 sequences
    assert decode_buckets(512)[-1] == 512 and DECODE_BUCKETS[-1] == 1024  # the CUDA default, and vLLM's H100 one
    assert decode_buckets(600)[-1] == 640 and decode_buckets(1024)[-2:] == (960, 1024)
    assert np.diff(DECODE_BUCKETS).max() <= 64  # padding within 64 rows, an eighth of a 512-sequence step
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def test_mixed_buckets_end_at_the_first_bucket_holding_the_token_cap():
    assert mixed_buckets(2048)[-1] == 2048 and mixed_buckets(2048)[:3] == (16, 32, 48)
    assert mixed_buckets(2000)[-1] == 2048
    assert mixed_buckets(1) == (16,) and mixed_buckets(17) == (16, 32)
    assert mixed_buckets(10**6) == MIXED_BUCKETS and MIXED_BUCKETS[-1] == 8192
    assert mixed_buckets(0) == ()  # off
    with pytest.raises(ValueError, match="max_tokens"):
        mixed_buckets(-1)


def test_mixed_buckets_pad_a_step_by_16_rows_or_a_quarter_and_at_most_128():
    assert list(MIXED_BUCKETS) == sorted(set(MIXED_BUCKETS))
    for smaller, larger in zip(MIXED_BUCKETS, MIXED_BUCKETS[1:]):
        tokens = smaller + 1  # the worst step: one token over the smaller bucket
        padding = larger - tokens
        assert padding <= 128 and padding <= max(16, tokens / 4), (smaller, larger)


@given(st.sampled_from([DECODE_BUCKETS, MIXED_BUCKETS, (4,), (3, 9, 27)]), st.integers(-3, 10_000))
def test_bucket_for_is_the_smallest_bucket_holding_the_size(buckets, size):
    chosen = bucket_for(buckets, size)
    holding = [b for b in buckets if b >= size]
    if size < 1 or not holding:
        assert chosen is None
    else:
        assert chosen == min(holding) and chosen in buckets


def test_bucket_for_refuses_an_empty_bucket_list():
    assert bucket_for((), 5) is None


def test_every_default_max_num_seqs_has_a_decode_graph_of_its_size():
    # A default above DECODE_BUCKETS' last bucket would send its full decode steps to the piecewise mixed-step
    # graphs (session 44 measured 1,024 sequences that way: 3.6 ms of host launch a step against 0.9 ms).
    from offline_paged.core.config import GiB, auto_max_num_seqs

    for backend, memory in (("cuda", 80 * GiB), ("cuda", 141 * GiB), ("cuda", 24 * GiB), ("cpu", None)):
        seqs = auto_max_num_seqs(backend, memory)
        assert decode_buckets(seqs)[-1] == seqs and seqs <= DECODE_BUCKETS[-1], (backend, memory, seqs)
