"""ModelRunner: turns a SchedulerOutput into arrays, moves KV blocks, runs the model and samples.

Legend: T tokens in the step, S scheduled sequences, M max blocks per sequence, K logits rows,
V vocab, L layers, N device blocks, C CPU blocks, B block size, Hkv KV heads, D head dim.

Order inside one step matters: swap-outs first (their device blocks may be handed to someone else
in this very step), then swap-ins, then copy-on-write copies, then the forward. Logits cross to the
host once per step, and only the rows that are sampled or scored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from offline_paged.models.attention import AttentionMetadata
from offline_paged.sampler import Sampler, SamplingRequest, log_softmax, top_logprobs
from offline_paged.sequence import SequenceResult

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


@dataclass(slots=True)
class _Batch:
    input_ids: Any  # [T] int32 (device)
    positions: Any  # [T] int32 (device)
    meta: AttentionMetadata
    logits_indices: Any  # [K] int32 (device)
    logits_offsets: list[int]  # per scheduled sequence: its first row in the [K, V] logits


class ModelRunner:
    """Owns the device KV pool [L, 2, N, B, Hkv, D] and the host swap pool [L, 2, C, B, Hkv, D]."""

    def __init__(self, model, backend, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 sampler: Sampler | None = None) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.sampler = sampler or Sampler()
        self.kv_cache = model.allocate_kv_cache(num_gpu_blocks, block_size)  # [L, 2, N, B, Hkv, D]
        shape = (*self.kv_cache.shape[:2], num_cpu_blocks, *self.kv_cache.shape[3:])
        self.cpu_kv_cache = np.zeros(shape, dtype=backend.dtype)  # [L, 2, C, B, Hkv, D]

    # ----------------------------------------------------------------- one step
    def execute(self, output) -> list[SequenceResult]:
        """Perform the step's block moves, run the forward and sample. One result per scheduled
        sequence, in order."""
        self.swap_out(output.blocks_to_swap_out)
        self.swap_in(output.blocks_to_swap_in)
        self.copy_blocks(output.blocks_to_copy)
        if not output.scheduled:
            return []
        batch = self._prepare(output.scheduled)
        logits = self.model.forward(batch.input_ids, batch.positions, self.kv_cache, batch.meta,
                                    batch.logits_indices)  # [K, V]
        logits = self.backend.to_host(logits)  # [K, V] float32, host
        return self._results(output.scheduled, logits, batch.logits_offsets)

    # ----------------------------------------------------------------- block moves
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            device_ids, cpu_ids = _split_pairs(pairs)
            moved = self.kv_cache[:, :, self.backend.int32(device_ids)]  # [L, 2, n, B, Hkv, D]
            self.cpu_kv_cache[:, :, cpu_ids] = self.backend.to_host(moved)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            cpu_ids, device_ids = _split_pairs(pairs)
            moved = self.backend.xp.asarray(self.cpu_kv_cache[:, :, cpu_ids])  # [L, 2, n, B, Hkv, D]
            self.kv_cache[:, :, self.backend.int32(device_ids)] = moved

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src_ids, dst_ids = _split_pairs(pairs)
            self.backend.ops.copy_blocks(self.kv_cache, self.backend.int32(src_ids),
                                         self.backend.int32(dst_ids))

    # ----------------------------------------------------------------- inputs
    def _prepare(self, scheduled) -> _Batch:
        block_size = self.block_size
        input_ids, positions, slots, logits_rows, offsets = [], [], [], [], []
        query_lens, context_lens = [], []
        width = max(len(item.block_table) for item in scheduled)
        block_tables = np.zeros((len(scheduled), width), dtype=np.int32)  # [S, M]
        for i, item in enumerate(scheduled):
            start, end = item.start, item.start + item.num_new_tokens
            table = np.asarray(item.block_table, dtype=np.int64)
            block_tables[i, :len(table)] = table
            pos = np.arange(start, end)  # [q_len]
            slot = table[pos // block_size] * block_size + pos % block_size  # [q_len]
            slot[pos < item.num_skip_write] = -1  # cached K/V recomputed for scores only
            first_row = len(input_ids)
            input_ids += item.seq.token_ids[start:end]
            positions.append(pos)
            slots.append(slot)
            offsets.append(len(logits_rows))
            if item.prompt_logprobs is not None:
                logits_rows += range(first_row, first_row + item.num_new_tokens)
            elif item.num_samples:
                logits_rows.append(first_row + item.num_new_tokens - 1)
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
        b = self.backend
        meta = AttentionMetadata(
            slot_mapping=b.int32(np.concatenate(slots)),
            block_tables=b.xp.asarray(block_tables),
            context_lens=b.int32(context_lens),
            query_start_loc=b.int32(np.concatenate([[0], np.cumsum(query_lens)])),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
        )
        return _Batch(b.int32(input_ids), b.int32(np.concatenate(positions)), meta,
                      b.int32(logits_rows), offsets)

    # ----------------------------------------------------------------- outputs
    def _results(self, scheduled, logits: np.ndarray, offsets: list[int]) -> list[SequenceResult]:
        requests, rows, owners = [], [], []
        for i, item in enumerate(scheduled):
            if not item.num_samples:
                continue
            row = offsets[i] + (item.num_new_tokens - 1 if item.prompt_logprobs is not None else 0)
            for request in _sampling_requests(item):
                requests.append(request)
                rows.append(row)
                owners.append(i)
        samples = self.sampler.sample(logits[rows], requests) if requests else []
        per_seq: list[list] = [[] for _ in scheduled]
        for owner, sample in zip(owners, samples):
            per_seq[owner].append(sample)
        return [
            SequenceResult(per_seq[i], _prompt_logprobs(item, logits, offsets[i]))
            for i, item in enumerate(scheduled)
        ]


def _sampling_requests(item) -> list[SamplingRequest]:
    """One request per sample drawn from this sequence's row (n of them when it forks)."""
    seq = item.seq
    seeds = seq.group.sample_seeds if item.num_samples > 1 else [seq.sampling_seed]
    prompt = seq.token_ids[:seq.num_prompt_tokens]
    output = seq.output_token_ids
    return [SamplingRequest(seq.group.params, seed, seq.num_output_tokens, prompt, output)
            for seed in seeds[:item.num_samples]]


def _prompt_logprobs(item, logits: np.ndarray, offset: int) -> list[dict[int, float]] | None:
    """Entries for prompt positions start+1 ... (the row at position q scores token q+1)."""
    if item.prompt_logprobs is None:
        return None
    seq = item.seq
    last = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
    num_rows = max(last - item.start, 0)
    if num_rows == 0:
        return []
    scores = log_softmax(logits[offset:offset + num_rows])  # [num_rows, V] float64
    targets = seq.token_ids[item.start + 1:item.start + 1 + num_rows]
    return [top_logprobs(row, item.prompt_logprobs, chosen=t) for row, t in zip(scores, targets)]


def _split_pairs(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in pairs], [b for _, b in pairs]


def kv_block_bytes(model_config, block_size: int, dtype) -> int:
    """Bytes of one KV block across all layers, K and V."""
    c = model_config
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
    return per_token * block_size * np.dtype(dtype).itemsize
