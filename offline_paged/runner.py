"""ModelRunner: turns a SchedulerOutput into arrays, moves KV blocks, runs the model and samples.

Legend: T tokens in the step, S scheduled sequences, M max blocks per sequence, K logits rows,
V vocab, L layers, N device blocks, C CPU blocks, B block size, Hkv KV heads, D head dim.

Order inside one step matters: swap-outs first (their device blocks may be handed to someone else
in this very step), then swap-ins, then copy-on-write copies, then the forward. Logits cross to the
host once per step, and only the rows that are sampled or scored. On CUDA the GpuSampler samples on the
device (only the sampled ids and requested log-probabilities come back); logits cross only for rows whose
prompt log-probabilities are asked for.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from offline_paged.block_table_rows import BlockTableRows
from offline_paged.models.attention import AttentionMetadata
from offline_paged.sampler import Sampler, SamplingRequest, log_softmax, top_logprobs
from offline_paged.launched_step import LaunchedStep, ReadySamples
from offline_paged.sequence import SequenceResult
from offline_paged.step_report import DeviceTimer

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


@dataclass(slots=True)
class _Batch:
    input_ids: Any  # [T] int32 (device)
    positions: Any  # [T] int32 (device)
    meta: AttentionMetadata
    logits_indices: Any  # [K] int32 (device)
    logits_offsets: list[int]  # per scheduled sequence: its first row in the [K, V] logits


class _StepUpload:
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
            from offline_paged.cuda.pinned import PinnedUpload

            self._pinned = PinnedUpload()
        if self._buffer is None or self._buffer.size < host.size:
            capacity = max(host.size, 2 * (0 if self._buffer is None else self._buffer.size), 4096)
            self._buffer = self.backend.xp.empty(capacity, dtype=np.int32)
        view = self._buffer[:host.size]  # [n] int32 (device)
        # Stream-ordered after the previous step's kernels (same stream), so reuse is safe.
        return self._pinned(host.astype(np.int32, copy=False), out=view)


class ModelRunner:
    """Owns the device KV pool [L, 2, N, B, Hkv, D] and, through the backend's swapper, the host swap
    pool [L, 2, C, B, Hkv, D] (pinned on CUDA; created on the first swap, so recompute-only runs
    never pin it)."""

    def __init__(self, model, backend, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 sampler: Sampler | None = None, device_sampling: bool | None = None,
                 cuda_graphs: bool = False, max_model_len: int | None = None) -> None:
        """device_sampling: sample on the GPU (None: whenever the backend is CUDA; False: on the host with
        `sampler`, the reference; True on the CPU backend is a ValueError).
        cuda_graphs: replay decode-only steps from CUDA graphs (offline_paged/cuda_graph_runner.py) where
        the backend is CUDA and the model float16 or bfloat16; needs max_model_len (the attention's static bound).
        Ignored on the CPU."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.sampler = sampler or Sampler()
        if device_sampling and backend.name != "cuda":
            raise ValueError(f"device_sampling needs the CUDA backend, not {backend.name!r}")
        self.gpu_sampler = None
        if backend.name == "cuda" and device_sampling is not False:
            from offline_paged.gpu_sampler import GpuSampler

            self.gpu_sampler = GpuSampler(self.sampler.eos_token_ids)
        self.kv_cache = model.allocate_kv_cache(num_gpu_blocks, block_size)  # [L, 2, N, B, Hkv, D]
        self._swapper = None
        self._upload = _StepUpload(backend)
        self._pending_upload = _StepUpload(backend)  # where a step's pending input ids come from
        max_blocks = 64 if max_model_len is None else -(-max_model_len // block_size)
        self.table_rows = BlockTableRows(block_size, max_blocks=max_blocks)  # rows live across steps
        self.decode_graphs = None
        if cuda_graphs and backend.name == "cuda" and np.dtype(model.dtype).name in ("float16", "bfloat16"):
            if max_model_len is None:
                raise ValueError("cuda_graphs needs max_model_len (the static attention bound)")
            from offline_paged.cuda_graph_runner import DecodeGraphs

            self.decode_graphs = DecodeGraphs(model, self.kv_cache, block_size, max_model_len)

    @property
    def swapper(self):
        """The backend's block swapper (swap_out(device_ids, cpu_ids), swap_in(cpu_ids, device_ids))."""
        if self._swapper is None:
            self._swapper = self.backend.ops.make_swapper(self.kv_cache, self.num_cpu_blocks)
        return self._swapper

    # ----------------------------------------------------------------- one step
    def execute(self, output) -> list[SequenceResult]:
        """Perform the step's block moves, run the forward and sample. One result per scheduled
        sequence, in order (`launch` + `wait`)."""
        return self.launch(output).wait().results

    def launch(self, output, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's block moves, forward and sampling; the sampled ids stay on the device until
        `wait()`. A sequence whose input token is still pending (async scheduling) gets it from
        `previous`, the step that samples it, on the device. RuntimeError if that step is not given."""
        self.swap_out(output.blocks_to_swap_out)
        self.swap_in(output.blocks_to_swap_in)
        self.copy_blocks(output.blocks_to_copy)
        self.table_rows.release(output.freed_seq_ids)
        if not output.scheduled:
            return LaunchedStep(output, ReadySamples([]), {}, [], [], None, False)
        rows = self.table_rows.sync(output.scheduled)  # [S] each sequence's block-table row
        fill = _pending_inputs(output.scheduled, previous, self._pending_upload)
        # CUDA events around the forward, never inside a capture (DecodeGraphs captures on its own
        # stream); started after the host-side input packing so that they time the device's work.
        timer = DeviceTimer(self.backend.xp) if self.backend.name == "cuda" else None
        replayed = self._replay_decode(output.scheduled, rows, timer, fill)
        if replayed is not None:
            logits, offsets = replayed  # [b, V] float32 (device), row i = sequence i
        else:
            batch = self._prepare(output.scheduled, rows)
            if fill is not None:
                fill(batch.input_ids)
            if timer is not None:
                timer.start()
            logits = self.model.forward(batch.input_ids, batch.positions, self.kv_cache, batch.meta,
                                        batch.logits_indices)  # [K, V] float32 (device)
            offsets = batch.logits_offsets
        if timer is not None:
            timer.stop()
        if self.gpu_sampler is None:
            logits = self.backend.to_host(logits)  # [K, V] float32: the step's one device->host copy
        return self._launch_sampling(output, logits, offsets, timer, replayed is not None)

    def _replay_decode(self, scheduled, rows: np.ndarray, timer=None, fill=None):
        """(logits [b, V], offsets) from a CUDA graph when every sequence computes one token and the
        step fits a bucket; None otherwise (the eager forward runs). rows [S]: block-table rows."""
        graphs = self.decode_graphs
        if graphs is None or any(item.num_new_tokens != 1 for item in scheduled):
            return None
        num_seqs, block_size = len(scheduled), self.block_size
        starts = np.fromiter((item.start for item in scheduled), np.int64, num_seqs)  # [S]
        if not graphs.fits(num_seqs, int(starts.max()) + 1, int(self.table_rows.lens[rows].max())):
            return None
        tables = self.table_rows.tables[rows]  # [S, M'] int32, zero-padded
        skips = np.fromiter((item.num_skip_write for item in scheduled), np.int64, num_seqs)  # [S]
        input_ids = np.fromiter((_input_token(item) for item in scheduled), np.int64, num_seqs)  # [S]
        slots = _slot_mapping(tables, np.arange(num_seqs), starts, skips, block_size)  # [S]
        logits = graphs.run(input_ids, starts, slots, tables, timer, fill)  # [b, V] float32 (device)
        return logits, list(range(num_seqs))

    # ----------------------------------------------------------------- block moves
    # Block ids stay on the host: the swapper and copy_blocks take host ids, so no move syncs the device.
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            device_ids, cpu_ids = _split_pairs(pairs)
            self.swapper.swap_out(device_ids, cpu_ids)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            cpu_ids, device_ids = _split_pairs(pairs)
            self.swapper.swap_in(cpu_ids, device_ids)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src_ids, dst_ids = _split_pairs(pairs)
            self.backend.ops.copy_blocks(self.kv_cache, np.asarray(src_ids, dtype=np.int64),
                                         np.asarray(dst_ids, dtype=np.int64))

    # ----------------------------------------------------------------- inputs
    def _prepare(self, scheduled, rows: np.ndarray) -> _Batch:
        """Pack the step's index arrays into one int32 host array, upload it once, slice views.
        Per-sequence Python is limited to reading each item's fields once; the rest is numpy.
        rows [S]: the sequences' rows in `table_rows` (synced for this step)."""
        block_size, num_seqs = self.block_size, len(scheduled)
        starts = np.fromiter((item.start for item in scheduled), np.int64, num_seqs)  # [S]
        query_lens = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, num_seqs)  # [S]
        skips = np.fromiter((item.num_skip_write for item in scheduled), np.int64, num_seqs)  # [S]
        context_lens = starts + query_lens  # [S]
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])  # [S + 1]
        num_tokens = int(query_start_loc[-1])
        width = int(self.table_rows.lens[rows].max())
        block_tables = self.table_rows.tables[rows, :width].astype(np.int64)  # [S, M] zero-padded
        input_ids = np.fromiter(itertools.chain.from_iterable(map(_input_tokens, scheduled)),
                                np.int64, num_tokens)  # [T] (0 where the token is pending)
        logits_rows, offsets = _logits_rows(scheduled, query_start_loc)
        owner = np.repeat(np.arange(num_seqs), query_lens)  # [T] sequence of each token
        positions = np.arange(num_tokens) - query_start_loc[owner] + starts[owner]  # [T]
        slots = _slot_mapping(block_tables, owner, positions, skips[owner], block_size)  # [T]
        parts = [input_ids, positions, slots, context_lens, query_start_loc, logits_rows, block_tables.ravel()]
        packed = self._upload(np.concatenate(parts).astype(np.int32))  # [sum of part sizes] int32
        views, at = [], 0
        for part in parts:
            views.append(packed[at:at + part.size])
            at += part.size
        ids, pos, slot_mapping, ctx, qsl, logits_indices, tables = views
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=tables.reshape(block_tables.shape),
            context_lens=ctx, query_start_loc=qsl,
            max_query_len=int(query_lens.max()), max_context_len=int(context_lens.max()),
        )
        return _Batch(ids, pos, meta, logits_indices, offsets)

    # ----------------------------------------------------------------- outputs
    def _launch_sampling(self, output, logits, offsets: list[int], timer, used_graph: bool) -> LaunchedStep:
        """Queue the sampling of every sampled row; prompt logprobs are computed now (on the host).
        logits [K, V]: host, or device when the GpuSampler samples (then prompt-logprob rows are copied
        to the host alone)."""
        scheduled = output.scheduled
        requests, rows, owners, sample_index = [], [], [], {}
        for i, item in enumerate(scheduled):
            if not item.num_samples:
                continue
            row = offsets[i] + (item.num_new_tokens - 1 if item.prompt_logprobs is not None else 0)
            sample_index[item.seq.seq_id] = len(requests)  # the seq's own token: its row's first draw
            for request in _sampling_requests(item):
                requests.append(request)
                rows.append(row)
                owners.append(i)
        if not requests:
            samples = ReadySamples([])
        elif self.gpu_sampler is not None:
            samples = self.gpu_sampler.sample_async(logits, rows, requests)
        else:
            samples = ReadySamples(self.sampler.sample(logits[rows], requests))
        prompt = [_prompt_logprobs(item, logits, offsets[i], self.backend.to_host) for i, item in enumerate(scheduled)]
        return LaunchedStep(output, samples, sample_index, owners, prompt, timer, used_graph)


def _slot_mapping(block_tables: np.ndarray, owner: np.ndarray, positions: np.ndarray,
                  skip_below: np.ndarray, block_size: int) -> np.ndarray:
    """[T] KV slot of each token: block `positions // B` of its sequence's row `owner` in block_tables,
    offset `positions % B`; -1 below `skip_below` (cached K/V recomputed for scores only: not rewritten)."""
    slots = block_tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    slots[positions < skip_below] = -1
    return slots


def _input_token(item) -> int:
    """A decode row's input token; 0 when it is still pending (filled on the device)."""
    ids = item.seq.token_ids
    return ids[item.start] if item.start < len(ids) else 0


def _input_tokens(item) -> list[int]:
    """A chunk's input tokens; zeros for pending ones (filled on the device)."""
    ids = item.seq.token_ids[item.start:item.start + item.num_new_tokens]
    missing = item.num_new_tokens - len(ids)
    return ids + [0] * missing if missing else ids


def _pending_inputs(scheduled, previous: LaunchedStep | None, upload):
    """None when every input token is known; else a function that writes the pending ones into a step's
    device input ids [T] (or [b] for a graph bucket), gathered from `previous`'s sampled ids."""
    token_index, dst, src = 0, [], []
    for item in scheduled:
        known = len(item.seq.token_ids)
        for position in range(max(item.start, known), item.start + item.num_new_tokens):
            if position != known or previous is None or item.seq.seq_id not in previous.sample_index:
                raise RuntimeError(f"sequence {item.seq.seq_id}: input token at {position} is pending "
                                   "but no launched step samples it")
            dst.append(token_index + position - item.start)
            src.append(previous.sample_index[item.seq.seq_id])
        token_index += item.num_new_tokens
    if not dst:
        return None
    indices = upload(np.asarray(dst + src, dtype=np.int32))  # [2n] int32 (device)
    dst_ids, src_ids = indices[:len(dst)], indices[len(dst):]
    sampled = previous.samples.token_ids  # [R] int32 (device)

    def fill(input_ids) -> None:
        input_ids[dst_ids] = sampled[src_ids]

    return fill


def _sampling_requests(item) -> list[SamplingRequest]:
    """One request per sample drawn from this sequence's row (n of them when it forks)."""
    seq = item.seq
    seeds = seq.group.sample_seeds if item.num_samples > 1 else [seq.sampling_seed]
    prompt = _TokenWindow(seq.token_ids, 0, seq.num_prompt_tokens)
    output = _TokenWindow(seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids))
    return [SamplingRequest(seq.group.params, seed, item.sample_position, prompt, output)
            for seed in seeds[:item.num_samples]]


class _TokenWindow(Sequence):
    """token_ids[start:stop] without the copy: most sampling rows only ask for its length (min_tokens);
    penalties iterate it. Valid until the sequence changes, i.e. for the step it was made in."""

    __slots__ = ("_ids", "_start", "_stop")

    def __init__(self, token_ids: list[int], start: int, stop: int) -> None:
        self._ids, self._start, self._stop = token_ids, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[self._start:self._stop][index]
        if not -len(self) <= index < len(self):
            raise IndexError("token window index out of range")
        return self._ids[self._start + index % len(self)]

    def __iter__(self):
        return itertools.islice(self._ids, self._start, self._stop)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self._ids[self._start:self._stop], dtype=dtype)


def _prompt_logprobs(item, logits, offset: int, to_host) -> list[dict[int, float]] | None:
    """Entries for prompt positions start+1 ... (the row at position q scores token q+1)."""
    if item.prompt_logprobs is None:
        return None
    seq = item.seq
    last = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
    num_rows = max(last - item.start, 0)
    if num_rows == 0:
        return []
    scores = log_softmax(to_host(logits[offset:offset + num_rows]))  # [num_rows, V] float64
    targets = seq.token_ids[item.start + 1:item.start + 1 + num_rows]
    return [top_logprobs(row, item.prompt_logprobs, chosen=t) for row, t in zip(scores, targets)]


def _logits_rows(scheduled, query_start_loc: np.ndarray) -> tuple[np.ndarray, list[int]]:
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


def _split_pairs(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in pairs], [b for _, b in pairs]


def profile_step_memory(model, backend, num_tokens: int, num_seqs: int, block_size: int,
                        eos_token_ids=()) -> int:
    """Bytes of device memory the largest step needs beyond the weights and the KV pool (CUDA only).

    Runs one dummy prefill of `num_tokens` tokens spread over `num_seqs` sequences (the token and
    sequence budgets of a step) against a scratch KV cache just big enough for it, then samples every
    sequence's last row on the device with top-p (the sampler's sorting path, its largest). CuPy's pool
    keeps freed blocks, so its growth over the step plus the free bytes it held at the start (which the
    step may have reused) bounds the step's high-water mark from above. The pool is emptied first, but
    free_all_blocks keeps split blocks, so in a process that ran other work the bound is loose (safe).
    """
    from offline_paged.gpu_sampler import GpuSampler
    from offline_paged.sampler import SamplingRequest
    from offline_paged.sampling_params import SamplingParams

    xp = backend.xp
    num_seqs = max(1, min(num_seqs, num_tokens))
    lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)  # [S]
    lens[:num_tokens % num_seqs] += 1
    blocks_per_seq = -(-lens // block_size)  # [S]
    tables = np.zeros((num_seqs, int(blocks_per_seq.max())), dtype=np.int64)  # [S, M]
    firsts = np.concatenate([[0], np.cumsum(blocks_per_seq)[:-1]])  # [S]
    for i in range(num_seqs):
        tables[i, :blocks_per_seq[i]] = firsts[i] + np.arange(blocks_per_seq[i])
    owner = np.repeat(np.arange(num_seqs), lens)  # [T]
    query_start_loc = np.concatenate([[0], np.cumsum(lens)])  # [S + 1]
    positions = np.arange(num_tokens) - query_start_loc[owner]  # [T]
    slots = tables[owner, positions // block_size] * block_size + positions % block_size  # [T]
    pool = xp.get_default_memory_pool()
    xp.cuda.Device().synchronize()
    pool.free_all_blocks()
    kv_cache = model.allocate_kv_cache(int(blocks_per_seq.sum()), block_size)  # [L, 2, N, B, Hkv, D]
    meta = AttentionMetadata(
        slot_mapping=backend.int32(slots), block_tables=backend.int32(tables),
        context_lens=backend.int32(lens), query_start_loc=backend.int32(query_start_loc),
        max_query_len=int(lens.max()), max_context_len=int(lens.max()))
    before, reusable = pool.total_bytes(), pool.free_bytes()
    logits = model.forward(backend.int32(np.zeros(num_tokens)), backend.int32(positions), kv_cache, meta,
                           backend.int32(query_start_loc[1:] - 1))  # [S, V] float32
    params = SamplingParams(temperature=1.0, top_p=0.9)
    requests = [SamplingRequest(params, i, 0, (0,), ()) for i in range(num_seqs)]
    GpuSampler(eos_token_ids).sample(logits, list(range(num_seqs)), requests)
    xp.cuda.Device().synchronize()
    peak = pool.total_bytes() - before + reusable
    del logits, kv_cache, meta
    pool.free_all_blocks()
    return int(peak)


def kv_block_bytes(model_config, block_size: int, dtype) -> int:
    """Bytes of one KV block across all layers, K and V."""
    c = model_config
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
    return per_token * block_size * np.dtype(dtype).itemsize
