"""step_inputs: the synthetic memory-profiling step and the decode-graph columns (CPU)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from offline_paged.worker.step_inputs import decode_columns, decode_pending_inputs, pending_inputs, synthetic_prefill


@pytest.mark.parametrize("num_tokens, num_seqs, block_size", [(100, 7, 16), (5, 9, 4), (64, 1, 16), (33, 4, 8)])
def test_synthetic_prefill_puts_every_token_in_its_own_slot_of_its_own_blocks(num_tokens, num_seqs, block_size):
    step = synthetic_prefill(num_tokens, num_seqs, block_size)
    lens, tables, slots = step["lens"], step["tables"], step["slots"]
    assert lens.sum() == num_tokens and lens.max() - lens.min() <= 1
    assert len(set(slots.tolist())) == num_tokens  # no two tokens share a slot
    assert step["num_blocks"] == int((-(-lens // block_size)).sum())
    owner = np.repeat(np.arange(lens.size), lens)
    for t in range(num_tokens):
        position = step["positions"][t]
        assert 0 <= position < lens[owner[t]]
        assert slots[t] == tables[owner[t], position // block_size] * block_size + position % block_size
        assert slots[t] < step["num_blocks"] * block_size
    np.testing.assert_array_equal(step["query_start_loc"], np.concatenate([[0], np.cumsum(lens)]))


def _item(seq_id, token_ids, start, skip, num_new=1, num_samples=1, prompt_logprobs=None):
    seq = SimpleNamespace(seq_id=seq_id, token_ids=token_ids, num_skip_write=skip)
    return SimpleNamespace(seq=seq, start=start, num_new_tokens=num_new, num_samples=num_samples,
                           prompt_logprobs=prompt_logprobs, sample_position=len(token_ids) - 1)


def test_decode_columns_flag_cached_tokens_and_leave_pending_ids_zero():
    columns = decode_columns([_item(4, [5, 6, 7], 2, 0), _item(9, [8, 9], 2, 0), _item(1, [1, 2, 3, 4], 1, 3)])
    assert columns.positions.tolist() == [2, 2, 1]
    assert columns.input_ids.tolist() == [7, 0, 2]  # the second one's token is still pending: filled on the device
    assert columns.writes.tolist() == [True, True, False]
    assert columns.seq_ids.tolist() == [4, 9, 1]
    assert columns.sample_positions.tolist() == [2, 1, 3]
    assert columns.one_sample_each


def test_decode_columns_refuse_a_chunk_and_flag_forks_and_prompt_logprobs():
    assert decode_columns([_item(0, [5, 6], 1, 0), _item(1, [5, 6, 7], 0, 0, num_new=3)]) is None
    assert not decode_columns([_item(0, [5, 6], 1, 0), _item(1, [7, 8], 1, 0, num_samples=3)]).one_sample_each
    assert not decode_columns([_item(0, [5, 6], 1, 0, prompt_logprobs=2)]).one_sample_each
    assert not decode_columns([_item(0, [5, 6], 1, 0, num_samples=0)]).one_sample_each


def test_pending_inputs_gather_each_pending_token_from_the_step_that_samples_it():
    # A decode with its token pending (sampled as entry 2 of the previous step), a chunk of known tokens, a
    # chunk whose last token is pending (entry 3), and a decode whose token is pending (entry 0).
    items = [_item(10, [5, 6, 7], 3, 0), _item(11, [1, 2, 3, 4, 5], 1, 0, num_new=3),
             _item(13, [1, 2, 3], 1, 0, num_new=3), _item(12, [8], 1, 0)]
    previous = SimpleNamespace(sample_index={10: 2, 12: 0, 13: 3, 99: 1},
                               samples=SimpleNamespace(token_ids=np.array([40, 41, 42, 43], dtype=np.int32)))
    fill = pending_inputs(items, previous, lambda host: host)
    input_ids = np.zeros(8, dtype=np.int32)  # [T]: 1 + 3 + 3 + 1 tokens
    fill(input_ids)
    assert input_ids.tolist() == [42, 0, 0, 0, 0, 0, 43, 40]
    assert pending_inputs(items[1:2], None, lambda host: host) is None  # nothing pending


@pytest.mark.parametrize("item, sample_index", [
    (_item(10, [5, 6, 7], 3, 0), {}),  # no launched step samples it
    (_item(10, [5, 6, 7], 3, 0, num_new=2), {10: 0}),  # two tokens pending: only one can be in flight
    (_item(10, [5, 6, 7], 4, 0), {10: 0}),  # starts past the one pending token
])
def test_pending_inputs_refuse_a_token_no_step_samples(item, sample_index):
    previous = SimpleNamespace(sample_index=sample_index, samples=SimpleNamespace(token_ids=np.zeros(1, np.int32)))
    with pytest.raises(RuntimeError, match="sequence 10: input token at . is pending"):
        pending_inputs([item], previous, lambda host: host)
    with pytest.raises(RuntimeError, match="is pending"):
        pending_inputs([item], None, lambda host: host)


def _graph_step(seq_ids, rows, token_ids):
    """A decode graph step's LaunchedStep fields: sample i drawn for seq_ids[i] on block-table row rows[i]."""
    return SimpleNamespace(sample_index=None, sample_rows=np.array(rows, dtype=np.int64),
                           sample_seq_ids=np.array(seq_ids, dtype=np.int64),
                           samples=SimpleNamespace(token_ids=np.array(token_ids, dtype=np.int32)))


def test_decode_pending_inputs_find_each_sample_by_block_table_row_as_pending_inputs_does():
    # Three decodes with their token pending and one whose token is known (position 1 of [5, 6]); the previous
    # step sampled them in another order, beside a sequence that finished since (seq 99, row 7).
    items = [_item(10, [5, 6, 7], 3, 0), _item(11, [5, 6], 1, 0), _item(12, [8], 1, 0), _item(13, [1, 2], 2, 0)]
    rows = np.array([4, 0, 2, 5], dtype=np.int64)
    previous = _graph_step([13, 99, 10, 12], [5, 7, 4, 2], [40, 41, 42, 43])
    columns = decode_columns(items)
    by_row, by_map = np.zeros(4, np.int32), np.zeros(4, np.int32)
    decode_pending_inputs(columns, rows, previous, lambda host: host)(by_row)
    pending_inputs(items, previous, lambda host: host)(by_map)  # the map built from sample_seq_ids
    assert by_row.tolist() == by_map.tolist() == [42, 0, 43, 40]
    assert decode_pending_inputs(decode_columns(items[1:2]), rows[1:2], previous, lambda host: host) is None


@pytest.mark.parametrize("rows, sampled_rows, sampled_seqs, start", [
    ([3], [4], [10], 3),  # no sample on its row
    ([3], [3], [11], 3),  # its row's sample went to another sequence (the row was reused)
    ([3], [3], [10], 4),  # starts past the one pending token
])
def test_decode_pending_inputs_refuse_a_token_no_step_samples(rows, sampled_rows, sampled_seqs, start):
    columns = decode_columns([_item(10, [5, 6, 7], start, 0)])
    previous = _graph_step(sampled_seqs, sampled_rows, [40])
    with pytest.raises(RuntimeError, match=f"sequence 10: input token at {start} is pending"):
        decode_pending_inputs(columns, np.array(rows, dtype=np.int64), previous, lambda host: host)


def _chunk(seq_id, num_tokens, start, num_new):
    item = _item(seq_id, list(range(2, 2 + num_tokens)), start, 0, num_new=num_new)
    item.block_table = list(range(seq_id * 8, seq_id * 8 + 8))
    item.num_skip_write = 0
    return item


@pytest.mark.parametrize("query_lens, expected", [([1, 1, 1, 5], 3), ([1, 1, 1], 0), ([4, 1, 1], 0),
                                                  ([1, 6, 1, 3], 1), ([7], 0)])
def test_pack_eager_counts_the_leading_decodes(query_lens, expected):
    """The attention of an eager step runs its leading one-token sequences apart (num_leading_decodes);
    0 when every sequence decodes (nothing to split) or the first one is a chunk."""
    from offline_paged.worker.block_table_rows import BlockTableRows
    from offline_paged.worker.step_inputs import pack_eager

    items = [_chunk(i, 20, 20 - n, n) for i, n in enumerate(query_lens)]
    table_rows = BlockTableRows(4, max_blocks=8)
    rows = table_rows.sync(items)
    packed, layout = pack_eager(items, table_rows, rows)
    assert layout.num_leading_decodes == expected
    assert layout.max_query_len == max(query_lens)


@pytest.mark.parametrize("query_lens, pad_to", [([1, 1, 5], 16), ([3], 3), ([1, 6, 1, 3], 32)])
def test_pack_eager_pads_ids_positions_and_slots_for_a_graph_bucket(query_lens, pad_to):
    """pad_to: input ids, positions and slots grow to the bucket with token 0 at position 0 and slot -1 (no KV
    write); every other part, and the real rows, are those of the unpadded step."""
    from offline_paged.worker.block_table_rows import BlockTableRows
    from offline_paged.worker.step_inputs import pack_eager, unpack_eager

    items = [_chunk(i, 20, 20 - n, n) for i, n in enumerate(query_lens)]
    table_rows = BlockTableRows(4, max_blocks=8)
    rows = table_rows.sync(items)
    plain = unpack_eager(*pack_eager(items, table_rows, rows), lambda host: host)
    padded = unpack_eager(*pack_eager(items, table_rows, rows, pad_to=pad_to), lambda host: host)
    num_tokens = sum(query_lens)
    for name in ("input_ids", "positions"):
        got, want = getattr(padded, name), getattr(plain, name)
        assert got.shape == (pad_to,)
        np.testing.assert_array_equal(got[:num_tokens], want)
        assert not got[num_tokens:].any()
    slots = padded.meta.slot_mapping
    np.testing.assert_array_equal(slots[:num_tokens], plain.meta.slot_mapping)
    assert (slots[num_tokens:] == -1).all() and (slots[:num_tokens] >= 0).all()
    for name in ("block_tables", "context_lens", "query_start_loc"):
        np.testing.assert_array_equal(getattr(padded.meta, name), getattr(plain.meta, name))
    np.testing.assert_array_equal(padded.logits_indices, plain.logits_indices)
    assert padded.meta.max_query_len == plain.meta.max_query_len
    with pytest.raises(ValueError, match="pad_to"):
        pack_eager(items, table_rows, rows, pad_to=num_tokens - 1)
