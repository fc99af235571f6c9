"""Step inputs: the one place a step's index arrays are built, for every path that runs the model.

- Eager steps (any mix of prefill chunks and decodes): `eager_batch` packs input ids, positions, slot
  mapping, context lengths, query_start_loc, logits rows and block tables (gathered from the persistent
  BlockTableRows) into one int32 array and uploads it once (`StepUpload`).
- Decode-only steps replayed from CUDA graphs: `decode_columns` gives the few per-sequence ints the graph
  uploads (and what the graph's sampler needs), in one pass over the scheduled sequences; the slot
  mapping, context lengths and block tables are derived from them on the device (cuda/step_inputs.cu,
  with the same formula as `slot_mapping`).
- The memory-profiling step: `synthetic_prefill`.
- Pending input tokens (async scheduling): `pending_inputs` gathers them on the device from the step
  that samples them, on either path.

Legend: T tokens in the step, S scheduled sequences, M max blocks per sequence, K logits rows.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from offline_paged.ops.attention import AttentionMetadata


@dataclass(slots=True, frozen=True)
class EagerLayout:
    """How `pack_eager`'s one int32 array splits into the step's parts, and the scalars that go with them.
    Tensor-parallel rank 0 sends it (with the packed array less its block tables) to the other ranks."""

    part_sizes: tuple[int, ...]  # input ids, positions, slots, context lens, query_start_loc, logits rows, tables
    table_shape: tuple[int, int]  # [S, M] the block tables' shape
    max_query_len: int
    max_context_len: int
    logits_offsets: list[int]  # per scheduled sequence: its first row in the [K, V] logits
    num_leading_decodes: int  # leading one-token sequences (0 when every sequence decodes)

    @property
    def num_table_entries(self) -> int:
        """Size of the block tables, the packed array's last part."""
        return self.part_sizes[-1]

    @property
    def table_width(self) -> int:
        """M, the block tables' width."""
        return self.table_shape[1]


@dataclass(slots=True)
class EagerBatch:
    input_ids: Any  # [T] int32 (device)
    positions: Any  # [T] int32 (device)
    meta: AttentionMetadata
    logits_indices: Any  # [K] int32 (device)
    logits_offsets: list[int]  # per scheduled sequence: its first row in the [K, V] logits


class StepUpload:
    """One preallocated device int32 buffer that a step's index arrays are packed into, so a step's
    inputs cross host->device in one copy and live at stable addresses (what CUDA graphs need next).
    On the CPU the packed host array is used as is."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._buffer = None  # [capacity] int32 (device), grown by doubling
        self._pinned = None  # cuda PinnedUpload: the copy is queued, the host does not wait for the device

    def __call__(self, host: np.ndarray):
        if self.backend.name == "cpu":
            return host
        if self._pinned is None:
            from offline_paged.ops.pinned import PinnedUpload

            self._pinned = PinnedUpload()
        if self._buffer is None or self._buffer.size < host.size:
            capacity = max(host.size, 2 * (0 if self._buffer is None else self._buffer.size), 4096)
            self._buffer = self.backend.xp.empty(capacity, dtype=np.int32)
        view = self._buffer[:host.size]  # [n] int32 (device)
        # Stream-ordered after the previous step's kernels (same stream), so reuse is safe.
        return self._pinned(host.astype(np.int32, copy=False), out=view)


def eager_batch(scheduled, table_rows, rows: np.ndarray, upload) -> EagerBatch:
    """An eager step's inputs: `pack_eager`, uploaded once by `upload` (a StepUpload) and sliced into
    views (`unpack_eager`). rows [S]: the sequences' rows in `table_rows` (synced for this step)."""
    return unpack_eager(*pack_eager(scheduled, table_rows, rows), upload)


def pack_eager(scheduled, table_rows, rows: np.ndarray,
               pad_to: int | None = None) -> tuple[np.ndarray, EagerLayout]:
    """The eager step's index arrays packed into one int32 host array, and its EagerLayout. Per-sequence Python is limited to reading each item's fields once; the
    rest is numpy. pad_to >= T: input ids, positions and slots padded to that many rows (token 0 at position 0,
    slot -1: no KV write), as a mixed-step graph bucket reads them; the other parts are the real sequences'."""
    block_size, num_seqs = table_rows.block_size, len(scheduled)
    starts = np.fromiter((item.start for item in scheduled), np.int64, num_seqs)  # [S]
    query_lens = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, num_seqs)  # [S]
    skips = np.fromiter((item.num_skip_write for item in scheduled), np.int64, num_seqs)  # [S]
    context_lens = starts + query_lens  # [S]
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])  # [S + 1]
    num_tokens = int(query_start_loc[-1])
    width = int(table_rows.lens[rows].max())
    block_tables = table_rows.tables[rows, :width].astype(np.int64)  # [S, M] zero-padded
    input_ids = np.fromiter(itertools.chain.from_iterable(map(input_tokens, scheduled)),
                            np.int64, num_tokens)  # [T] (0 where the token is pending)
    rows_needed, offsets = logits_rows(scheduled, query_start_loc)
    owner = np.repeat(np.arange(num_seqs), query_lens)  # [T] sequence of each token
    positions = np.arange(num_tokens) - query_start_loc[owner] + starts[owner]  # [T]
    slots = slot_mapping(block_tables, owner, positions, skips[owner], block_size)  # [T]
    if pad_to is not None:
        if pad_to < num_tokens:
            raise ValueError(f"pad_to={pad_to} is below the step's {num_tokens} tokens")
        padding = pad_to - num_tokens
        input_ids, positions = np.pad(input_ids, (0, padding)), np.pad(positions, (0, padding))  # [pad_to]
        slots = np.pad(slots, (0, padding), constant_values=-1)  # [pad_to]
    parts = [input_ids, positions, slots, context_lens, query_start_loc, rows_needed, block_tables.ravel()]
    longer = np.flatnonzero(query_lens != 1)
    num_leading_decodes = int(longer[0]) if longer.size else 0  # 0 when all decode: no split
    layout = EagerLayout(part_sizes=tuple(part.size for part in parts), table_shape=block_tables.shape,
                         max_query_len=int(query_lens.max()), max_context_len=int(context_lens.max()),
                         logits_offsets=offsets, num_leading_decodes=num_leading_decodes)
    return np.concatenate(parts).astype(np.int32), layout  # [sum of part sizes] int32


def unpack_eager(host_packed: np.ndarray, layout: EagerLayout, upload) -> EagerBatch:
    """Upload a `pack_eager`ed step once and slice its views."""
    packed = upload(host_packed)  # [sum of part sizes] int32 (device)
    views, at = [], 0
    for size in layout.part_sizes:
        views.append(packed[at:at + size])
        at += size
    ids, pos, slot_view, ctx, qsl, logits_indices, tables = views
    meta = AttentionMetadata(
        slot_mapping=slot_view, block_tables=tables.reshape(layout.table_shape), context_lens=ctx,
        query_start_loc=qsl, max_query_len=layout.max_query_len, max_context_len=layout.max_context_len,
        num_leading_decodes=layout.num_leading_decodes,
    )
    return EagerBatch(ids, pos, meta, logits_indices, layout.logits_offsets)


@dataclass(slots=True)
class DecodeColumns:
    """A decode-only step's per-sequence fields for the graph path. The slot mapping, context lengths and
    block tables are computed from positions and writes on the device (cuda/step_inputs.cu)."""

    positions: np.ndarray  # [S] int64
    input_ids: np.ndarray  # [S] int64, 0 where pending (filled on the device)
    writes: np.ndarray  # [S] bool, False: the cached token's K/V is not rewritten
    seq_ids: np.ndarray  # [S] int64
    sample_positions: np.ndarray  # [S] int64 output position each row samples
    num_known: np.ndarray  # [S] int64 tokens known on the host: the input at positions >= num_known is pending
    one_sample_each: bool  # every row draws exactly one token and asks no prompt logprobs


def decode_columns(scheduled) -> DecodeColumns | None:
    """The step's DecodeColumns, or None when some sequence computes more than one token (not a decode-only
    step). One Python pass over the sequences; the arrays are built from its lists."""
    positions, input_ids, writes, seq_ids, sample_positions, num_known = [], [], [], [], [], []
    one_sample_each = True
    for item in scheduled:
        if item.num_new_tokens != 1:
            return None
        seq, start = item.seq, item.start
        token_ids = seq.token_ids
        known = len(token_ids)
        positions.append(start)
        input_ids.append(token_ids[start] if start < known else 0)  # 0: pending
        writes.append(start >= seq.num_skip_write)
        seq_ids.append(seq.seq_id)
        sample_positions.append(item.sample_position)
        num_known.append(known)
        if item.num_samples != 1 or item.prompt_logprobs is not None:
            one_sample_each = False
    return DecodeColumns(np.array(positions, dtype=np.int64), np.array(input_ids, dtype=np.int64),
                         np.array(writes, dtype=bool), np.array(seq_ids, dtype=np.int64),
                         np.array(sample_positions, dtype=np.int64), np.array(num_known, dtype=np.int64),
                         one_sample_each)


def synthetic_prefill(num_tokens: int, num_seqs: int, block_size: int) -> dict[str, np.ndarray]:
    """The memory-profiling step's inputs: `num_tokens` prompt tokens over `num_seqs` sequences on
    consecutive blocks from 0 (the eager path's arrays, through the same slot_mapping)."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)  # [S]
    lens[:num_tokens % num_seqs] += 1
    blocks_per_seq = -(-lens // block_size)  # [S]
    firsts = np.concatenate([[0], np.cumsum(blocks_per_seq)[:-1]])  # [S]
    columns = np.arange(int(blocks_per_seq.max()))  # [M]
    tables = np.where(columns < blocks_per_seq[:, None], firsts[:, None] + columns, 0)  # [S, M]
    owner = np.repeat(np.arange(num_seqs), lens)  # [T]
    query_start_loc = np.concatenate([[0], np.cumsum(lens)])  # [S + 1]
    positions = np.arange(num_tokens) - query_start_loc[owner]  # [T]
    slots = slot_mapping(tables, owner, positions, np.zeros(num_tokens, np.int64), block_size)  # [T]
    return dict(lens=lens, tables=tables, positions=positions, slots=slots, query_start_loc=query_start_loc,
                num_blocks=int(blocks_per_seq.sum()))


def slot_mapping(block_tables: np.ndarray, owner: np.ndarray, positions: np.ndarray,
                  skip_below: np.ndarray, block_size: int) -> np.ndarray:
    """[T] KV slot of each token: block `positions // B` of its sequence's row `owner` in block_tables,
    offset `positions % B`; -1 below `skip_below` (cached K/V recomputed for scores only: not rewritten)."""
    slots = block_tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    slots[positions < skip_below] = -1
    return slots


def input_tokens(item) -> list[int]:
    """A chunk's input tokens; zeros for pending ones (filled on the device)."""
    ids = item.seq.token_ids[item.start:item.start + item.num_new_tokens]
    missing = item.num_new_tokens - len(ids)
    return ids + [0] * missing if missing else ids


def pending_inputs(scheduled, previous, upload):
    """None when every input token is known; else a function that writes the pending ones into a step's
    device input ids [T] (or [b] for a graph bucket), gathered from `previous`'s sampled ids."""
    sample_index = {} if previous is None else previous.sample_index
    if sample_index is None:  # a decode graph step's (LaunchedStep.sample_seq_ids): built when a chunk needs it
        sample_index = dict(zip(previous.sample_seq_ids.tolist(), range(len(previous.sample_seq_ids))))
    token_index, dst, src = 0, [], []
    for item in scheduled:
        start, num_new, seq_id = item.start, item.num_new_tokens, item.seq.seq_id
        known = len(item.seq.token_ids)
        if start + num_new > known:  # pending: only position `known` can be, sampled by `previous`
            index = sample_index.get(seq_id)
            if start > known or index is None or start + num_new > known + 1:
                # The first position nothing feeds: the chunk starts past the known tokens, or `previous`
                # does not sample position `known`, or the chunk needs the one after it too.
                position = start if start > known else known if index is None else known + 1
                raise RuntimeError(f"sequence {seq_id}: input token at {position} is pending "
                                   "but no launched step samples it")
            dst.append(token_index + known - start)
            src.append(index)
        token_index += num_new
    if not dst:
        return None
    return _gather_pending(np.asarray(dst + src, dtype=np.int32), len(dst), previous, upload)


def decode_pending_inputs(columns: DecodeColumns, rows: np.ndarray, previous, upload):
    """pending_inputs for a decode-only step (columns, its block-table rows [S]) whose pending tokens a decode
    graph step drew, one per sequence (previous.sample_rows and sample_seq_ids set): each pending sequence
    finds its sample by its block-table row, in NumPy rather than a Python pass over the sequences. A row
    that `previous` did not sample, or sampled for another sequence, raises RuntimeError as pending_inputs."""
    dst = np.flatnonzero(columns.positions >= columns.num_known)  # [P] rows whose input is pending
    if not dst.size:
        return None
    sample_rows = previous.sample_rows  # [R] block-table row of each sample's sequence
    sample_of_row = np.full(max(int(rows.max()), int(sample_rows.max())) + 1, -1, dtype=np.int64)
    sample_of_row[sample_rows] = np.arange(len(sample_rows))
    src = sample_of_row[rows[dst]]  # [P] (-1: no sample on that row)
    fed = (src >= 0) & (columns.positions[dst] == columns.num_known[dst])
    fed[fed] = previous.sample_seq_ids[src[fed]] == columns.seq_ids[dst[fed]]
    if not fed.all():
        first = dst[np.argmin(fed)]
        raise RuntimeError(f"sequence {columns.seq_ids[first]}: input token at {columns.positions[first]} is "
                           "pending but no launched step samples it")
    return _gather_pending(np.concatenate([dst, src]).astype(np.int32), len(dst), previous, upload)


def _gather_pending(indices: np.ndarray, num_pending: int, previous, upload):
    """The fill of pending_inputs: indices [2P] int32 are P destinations in the input ids, then P sources
    in previous's sampled ids."""
    indices = upload(indices)  # [2P] int32 (device)
    dst_ids, src_ids = indices[:num_pending], indices[num_pending:]
    sampled = previous.samples.token_ids  # [R] int32 (device)

    def fill(input_ids) -> None:
        input_ids[dst_ids] = sampled[src_ids]

    return fill


def logits_rows(scheduled, query_start_loc: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """([K] rows of T whose logits are needed, each sequence's first row among them). A sampled
    sequence needs its last row; one asking for prompt log-probabilities needs all its rows."""
    if all(item.prompt_logprobs is None for item in scheduled):
        sampled = np.fromiter((item.num_samples > 0 for item in scheduled), bool, len(scheduled))  # [S]
        counts = np.cumsum(sampled)  # [S]
        return query_start_loc[1:][sampled] - 1, (counts - sampled).tolist()
    rows, offsets = [], []
    for i, item in enumerate(scheduled):
        first_row, last_row = int(query_start_loc[i]), int(query_start_loc[i + 1])
        offsets.append(len(rows))
        if item.prompt_logprobs is not None:
            rows += range(first_row, last_row)
        elif item.num_samples:
            rows.append(last_row - 1)
    return np.asarray(rows, dtype=np.int64), offsets
