"""PoolingRunner: prompts -> embeddings, through the model's plain prefill forward (no sampling).

Legend: T tokens of one forward, E hidden size, S prompts in it, M blocks per prompt.

Each forward takes whole prompts up to `max_num_batched_tokens` tokens (a longer prompt runs alone)
and writes their K/V into a scratch pool sized for that batch only, with contiguous block tables, so
the engine's KV pool, prefix cache and running requests are never touched. Only the rows pooling reads
come back to the host: each prompt's last (LAST), first (CLS) or all (MEAN) final hidden states.
"""
from __future__ import annotations

import numpy as np

from offline_paged.models.pooling import PoolingConfig, pool
from offline_paged.models.simple_runner import build_metadata


class PoolingRunner:
    """Embeddings of token-id prompts with a `Llama` (any backend: NumPy or CuPy `ops`)."""

    def __init__(self, model, block_size: int, max_num_batched_tokens: int) -> None:
        self.model = model
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens

    def embed(self, prompts: list[list[int]], config: PoolingConfig) -> list[np.ndarray]:
        """One float32 vector [E] per prompt, in order (prompts are validated by the caller)."""
        vectors: list[np.ndarray] = []
        for batch in self._batches(prompts):
            vectors += self._embed_batch(batch, config)
        return vectors

    def _batches(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        batches: list[list[list[int]]] = [[]]
        for prompt in prompts:
            if batches[-1] and sum(map(len, batches[-1])) + len(prompt) > self.max_num_batched_tokens:
                batches.append([])
            batches[-1].append(prompt)
        return [b for b in batches if b]

    def _embed_batch(self, batch: list[list[int]], config: PoolingConfig) -> list[np.ndarray]:
        xp = self.model.ops.xp
        lengths = [len(p) for p in batch]
        tables, next_block = [], 0
        for length in lengths:
            num_blocks = -(-length // self.block_size)
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        slots = [table[pos // self.block_size] * self.block_size + pos % self.block_size
                 for table, length in zip(tables, lengths) for pos in range(length)]
        meta = build_metadata(xp, tables, lengths, lengths, slots)
        input_ids = xp.asarray([t for p in batch for t in p], dtype=xp.int32)  # [T]
        positions = xp.asarray([pos for length in lengths for pos in range(length)], dtype=xp.int32)  # [T]
        rows, spans = _pooled_rows(lengths, config.pooling_type)
        kv_cache = self.model.allocate_kv_cache(next_block, self.block_size)
        hidden = self.model.final_hidden(input_ids, positions, kv_cache, meta,
                                         xp.asarray(rows, dtype=xp.int32))  # [K, E]
        hidden = hidden.get() if hasattr(hidden, "get") else np.asarray(hidden)
        return [pool(hidden[start:end], config) for start, end in spans]


def _pooled_rows(lengths: list[int], pooling_type: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(rows of the batch pooling reads, each prompt's [start, end) within those rows)."""
    rows: list[int] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for length in lengths:
        wanted = {"LAST": [offset + length - 1], "CLS": [offset]}.get(pooling_type) or \
            list(range(offset, offset + length))
        spans.append((len(rows), len(rows) + len(wanted)))
        rows += wanted
        offset += length
    return rows, spans
