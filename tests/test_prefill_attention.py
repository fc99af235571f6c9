"""prefill_attention.cu (the FlashAttention-2-style kernel paged_attention runs for queries of 128+ rows)
against the NumPy reference on random inputs with shuffled block tables, in fp16 and bf16. Needs a GPU.

Cases: head dims 64 and 128; GQA ratios 1, 3, 4, 8; block sizes 16, 8, 32 and 5 (not a power of two);
full prefills, chunks on top of a cached prefix (context_len > q_len), decodes in the same batch, query
lengths that are no multiple of the 128-row tile; causal and sliding windows (blocks wholly before every
window poisoned with NaN); planned and forced key splits; rows of no sequence, zero_fill and
launch_order as paged_attention promises them for every kernel. The cache is NaN wherever no token lives,
so a kernel that reads past a context fails loudly.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from test_launchers import (DTYPES, TOL, assert_close, free_blocks_before_windows, make_paged_case,  # noqa: E402
                            run_attention, spare_block)

from offline_paged.ops import launchers  # noqa: E402  (needs cupy)

# (q_len, context_len): prefills longer and shorter than a tile, a chunk on a prefix, decodes, q_len not a
# multiple of any tile, a chunk whose prefix is many tiles long.
MIXED = [(300, 300), (130, 500), (1, 77), (129, 129), (7, 7), (200, 1000), (1, 1), (45, 46)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 8, 32, 5])
def test_prefill_kernel_matches_reference_on_mixed_batches(block_size, group, head_dim, dtype):
    rng = np.random.default_rng([block_size, group, head_dim])
    case = make_paged_case(rng, MIXED, block_size, 2, head_dim, group, dtype=dtype)
    assert launchers.choose_attention_kernel(300, group) == "prefill"
    out, ref = run_attention(case)  # the launcher's own choice: this kernel
    assert_close(out, ref, TOL[dtype])
    for num_splits in (1, 3):
        out_split, _ = run_attention(case, num_splits=num_splits)
        assert_close(out_split, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (64, 8), (128, 3)])
@pytest.mark.parametrize("block_size,window", [(16, 20), (16, 64), (8, 200), (32, 33), (5, 100), (16, 1)])
def test_prefill_kernel_sliding_window(block_size, window, head_dim, group, dtype):
    """Windows narrower than a tile, equal to one, spanning several; blocks before each sequence's first
    window poisoned (a sliding-window engine may have freed them)."""
    rng = np.random.default_rng([block_size, window, head_dim, group])
    seqs = [(300, 300), (150, 700), (1, 300), (40, 233), (129, 129), (260, 2100)]
    case = make_paged_case(rng, seqs, block_size, 2, head_dim, group, spare_blocks=1, dtype=dtype)
    free_blocks_before_windows(case, window, spare_block(case))
    for num_splits in (None, 1, 2, 5):
        out, ref = run_attention(case, num_splits=num_splits, window=window, kernel="prefill")
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 4)])
def test_long_prefill_equals_reference_and_the_row_split_kernel(head_dim, group, dtype):
    """One 2,000-token prompt and a 1,000-token chunk on a 3,000-token prefix: many key tiles per row
    tile (the online softmax across tiles), tiles skipped above the diagonal."""
    rng = np.random.default_rng(head_dim)
    case = make_paged_case(rng, [(2000, 2000), (1000, 4000)], 16, 2, head_dim, group, dtype=dtype)
    out, ref = run_attention(case, kernel="prefill")
    assert_close(out, ref, TOL[dtype])
    row_split, _ = run_attention(case, kernel="rowsplit")
    assert_close(out, row_split.astype(np.float64), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_kernel_leaves_rows_of_no_sequence_zero(dtype):
    rng = np.random.default_rng(5)
    q, k_cache, v_cache, tables, ctx, qsl = make_paged_case(rng, [(150, 170), (3, 3)], 16, 2, 64, 2, dtype=dtype)
    q_padded = np.concatenate([q, rng.standard_normal((37,) + q.shape[1:]).astype(dtype)])
    for num_splits in (None, 3):
        out = launchers.paged_attention(cupy.asarray(q_padded), cupy.asarray(k_cache), cupy.asarray(v_cache),
                                        cupy.asarray(tables), cupy.asarray(ctx), cupy.asarray(qsl), 150, 170, 0.125,
                                        num_splits=num_splits, kernel="prefill").get().astype(np.float32)
        assert (np.abs(out[:len(q)]).max(axis=(1, 2)) > 0).all()
        assert np.all(out[len(q):] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_writes_every_row_without_zero_fill_and_ignores_launch_order(head_dim, dtype):
    """zero_fill=False gives bit for bit the zero-filled result (every row belongs to a sequence), and a
    launch order changes nothing but the order."""
    rng = np.random.default_rng(head_dim)
    seqs = [(300, 300), (1, 90), (130, 533), (1, 1), (70, 70)]
    case = make_paged_case(rng, seqs, 16, 2, head_dim, 4, dtype=dtype)
    args = [cupy.asarray(a) for a in case]
    filled = launchers.paged_attention(*args, 300, 533, 0.125, kernel="prefill")
    garbage = cupy.full(filled.shape, np.nan, dtype=filled.dtype)  # freed below: the pool reuses it
    del garbage
    unfilled = launchers.paged_attention(*args, 300, 533, 0.125, zero_fill=False, kernel="prefill")
    np.testing.assert_array_equal(unfilled.get().view(np.uint16), filled.get().view(np.uint16))
    order = cupy.asarray(rng.permutation(len(seqs)).astype(np.int32))
    ordered = launchers.paged_attention(*args, 300, 533, 0.125, launch_order=order, kernel="prefill")
    np.testing.assert_array_equal(ordered.get().view(np.uint16), filled.get().view(np.uint16))


def test_kernel_choice_and_refusal():
    assert launchers.choose_attention_kernel(1, 8) == "decode"
    assert launchers.choose_attention_kernel(2, 4) == "decode"
    assert launchers.choose_attention_kernel(3, 4) == "keysplit"
    assert launchers.choose_attention_kernel(1, 16) == "keysplit"
    assert launchers.choose_attention_kernel(16, 4) == "rowsplit"
    assert launchers.choose_attention_kernel(32, 4) == "prefill"
    assert launchers.choose_attention_kernel(8192, 1) == "prefill"
    rng = np.random.default_rng(3)
    args = [cupy.asarray(a) for a in make_paged_case(rng, [(5, 5)], 16, 1, 64, 1)]
    with pytest.raises(ValueError, match="kernel must be None or one of"):
        launchers.paged_attention(*args, 5, 5, 0.125, kernel="flash")
