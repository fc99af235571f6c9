"""The eager LM head's row buckets (ops/logits_rows.py): every row count maps to a bucket that holds it, from a
short list, with little padding."""
from __future__ import annotations

from hypothesis import given, strategies as st

from offline_paged.ops.logits_rows import LOGITS_ROW_STEP, logits_buckets, logits_rows


def test_small_counts_take_powers_of_two_from_8_then_multiples_of_256():
    assert [logits_rows(n) for n in (0, 1, 8, 9, 16, 17, 129, 256, 257, 512, 513, 8192)] == \
        [0, 8, 8, 16, 16, 32, 256, 256, 512, 512, 768, 8192]
    assert logits_buckets(256) == [8, 16, 32, 64, 128, 256]
    assert logits_buckets(1) == [8] and logits_buckets(0) == [] and logits_buckets(600) == [8, 16, 32, 64, 128, 256,
                                                                                           512, 768]


@given(st.integers(1, 20_000), st.integers(0, 20_000))
def test_every_count_up_to_the_maximum_lands_in_its_buckets(num_rows, extra):
    rows = logits_rows(num_rows)
    assert rows >= num_rows and rows in logits_buckets(num_rows + extra)
    assert rows - num_rows < max(num_rows, 8) and (num_rows <= LOGITS_ROW_STEP or rows - num_rows < LOGITS_ROW_STEP)
    buckets = logits_buckets(num_rows + extra)
    assert buckets == sorted(set(buckets)) and buckets[-1] == logits_rows(num_rows + extra)
