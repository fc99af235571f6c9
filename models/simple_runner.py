"""SimpleRunner: drives `Llama.forward` directly, without the engine (tests, benchmarks, debugging).

It owns a KV pool whose free blocks are handed out in a shuffled order, so block tables are
non-contiguous on purpose, builds `AttentionMetadata` by hand and offers greedy generation.
It is not the engine's runner: no scheduling, no preemption, no prefix sharing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from offline_paged.ops.attention import AttentionMetadata


@dataclass(slots=True)
class _SeqState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the pool


class SimpleRunner:
    """A block pool plus per-sequence block tables. `step` takes (seq_id, new_token_ids) pairs —
    any mix of prefill chunks and single decode tokens — and returns logits per sequence."""

    def __init__(self, model, num_blocks: int, block_size: int, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        self.free_blocks = list(np.random.default_rng(seed).permutation(num_blocks).tolist())
        self.seqs: dict[int, _SeqState] = {}

    def step(self, batch: list[tuple[int, list[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """Compute `new_token_ids` for each sequence on top of its cached tokens. Returns, per entry,
        float32 logits [V] of its last token, or [q_len, V] for every new token when `all_logits`."""
        xp = self.model.ops.xp
        input_ids, positions, slots, query_lens, logits_rows = [], [], [], [], []
        for seq_id, new_ids in batch:
            state = self.seqs.setdefault(seq_id, _SeqState())
            start = state.num_cached
            self._reserve(state, start + len(new_ids))
            input_ids += new_ids
            for pos in range(start, start + len(new_ids)):
                positions.append(pos)
                slots.append(state.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
            first_row = len(input_ids) - len(new_ids)
            logits_rows += range(first_row if all_logits else len(input_ids) - 1, len(input_ids))
            query_lens.append(len(new_ids))
            state.num_cached += len(new_ids)
        meta = build_metadata(xp, [self.seqs[s].block_table for s, _ in batch],
                              [self.seqs[s].num_cached for s, _ in batch], query_lens, slots)
        logits = self.model.forward(xp.asarray(input_ids, dtype=xp.int32), xp.asarray(positions, dtype=xp.int32),
                                    self.kv_cache, meta, xp.asarray(logits_rows, dtype=xp.int32))  # [K, V]
        logits = logits.get() if hasattr(logits, "get") else logits
        return self._split(logits, query_lens, all_logits)

    @staticmethod
    def _split(logits, query_lens, all_logits):
        if not all_logits:
            return list(logits)
        return np.split(logits, np.cumsum(query_lens)[:-1])

    def _reserve(self, state: _SeqState, num_tokens: int) -> None:
        needed = -(-num_tokens // self.block_size) - len(state.block_table)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"SimpleRunner: KV pool exhausted (need {needed} blocks, {len(self.free_blocks)} free)")
        for _ in range(needed):
            state.block_table.append(self.free_blocks.pop())

    def free(self, seq_id: int) -> None:
        self.free_blocks += self.seqs.pop(seq_id).block_table

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, prefill_chunk: int | None = None) -> list[list[int]]:
        """Greedy continuation of every prompt (no stop tokens), all sequences batched together."""
        seq_ids = [max(self.seqs, default=-1) + 1 + i for i in range(len(prompts))]
        last_logits = self.prefill(list(zip(seq_ids, prompts)), prefill_chunk)
        outputs = [[int(np.argmax(row))] for row in last_logits]
        for _ in range(max_new_tokens - 1):
            rows = self.step([(s, out[-1:]) for s, out in zip(seq_ids, outputs)])
            for out, row in zip(outputs, rows):
                out.append(int(np.argmax(row)))
        for s in seq_ids:
            self.free(s)
        return outputs

    def prefill(self, batch: list[tuple[int, list[int]]], chunk: int | None = None) -> list[np.ndarray]:
        """Prefill every prompt, `chunk` tokens per sequence per step (None: all at once);
        returns each sequence's last-token logits."""
        chunk = chunk or max(len(p) for _, p in batch)
        last: dict[int, np.ndarray] = {}
        for start in range(0, max(len(p) for _, p in batch), chunk):
            part = [(s, p[start:start + chunk]) for s, p in batch if p[start:start + chunk]]
            for (s, _), row in zip(part, self.step(part)):
                last[s] = row
        return [last[s] for s, _ in batch]


def build_metadata(xp, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                   slot_mapping: list[int]) -> AttentionMetadata:
    """AttentionMetadata from plain lists; block tables are right-padded with 0 to a rectangle."""
    width = max(len(t) for t in block_tables)
    tables = np.zeros((len(block_tables), width), dtype=np.int32)  # [S, M]
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = table
    return AttentionMetadata(
        slot_mapping=xp.asarray(slot_mapping, dtype=xp.int32),
        block_tables=xp.asarray(tables),
        context_lens=xp.asarray(context_lens, dtype=xp.int32),
        query_start_loc=xp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), dtype=xp.int32),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
