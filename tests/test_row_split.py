"""ops/row_split.py: how many CTAs of a cluster share a row of silu_mul_fp8_product, and their threads (CPU)."""
from offline_paged.ops.row_split import busiest_sm_rows, row_split, split_threads

SMS = 132  # an H100 / H200


def test_a_decode_step_just_past_the_sms_splits_its_rows_in_four():
    # 136 rows: one block a row puts two rows on 4 SMs; quartered, the busiest SM holds 5 quarters
    assert busiest_sm_rows(136, 1, SMS) == 2 and busiest_sm_rows(136, 4, SMS) == 1.25
    assert row_split(136, SMS) == 4
    assert row_split(200, SMS) == 4  # 7 quarters against 2 rows


def test_few_rows_spread_over_idle_sms_and_ties_keep_the_smaller_split():
    assert row_split(64, SMS) == 2  # 128 halves on 132 SMs; quarters would leave the busiest SM the same half row
    assert row_split(33, SMS) == 4
    assert row_split(1, SMS) == 4
    assert row_split(100, SMS) == 1  # a row an SM however it is cut
    assert row_split(256, SMS) == 1  # two rows an SM however it is cut


def test_many_rows_or_no_clusters_keep_one_block_a_row():
    assert row_split(2 * SMS + 1, SMS) == 1
    assert row_split(8192, SMS) == 1  # a prefill chunk
    assert row_split(136, SMS, splits=(1,)) == 1  # before sm_90
    assert row_split(0, SMS) == 1


def test_the_busiest_sms_pieces_fit_on_it_together():
    # 136 rows in quarters: 5 pieces an SM, so at most 1024 // 5 threads each, rounded down to a warp
    assert split_threads(1792, 136, 4, SMS) == 192
    assert split_threads(1792, 64, 2, SMS) == 896  # one piece an SM: one 8-wide chunk a thread
    assert split_threads(1024, 1, 4, SMS) == 256  # the 1B shape's 8,192 columns, a quarter of 1,024 chunks
    assert split_threads(36, 3, 4, SMS) == 32  # the scalar path's few elements: one warp
    for rows in range(1, 2 * SMS + 1):
        split = row_split(rows, SMS)
        threads = split_threads(1792, rows, split, SMS)
        pieces = -(-rows * split // SMS)
        assert threads % 32 == 0 and 32 <= threads and (pieces * threads <= 1024 or threads == 32)
