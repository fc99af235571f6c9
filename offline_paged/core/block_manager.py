"""Per-sequence block tables over a GPU and a CPU ``BlockAllocator``: prefix reuse, copy-on-write, swap.

The manager never touches KV memory. It hands out slots and returns the block copies the runner
must perform. Executing the returned pairs *in the order the calls were made* is always correct.
The runner instead groups one step's copies as swap-outs, then swap-ins, then copy-on-write copies,
then runs the forward pass. That grouping gives the same result provided that, within one step,
(a) no ``swap_out`` follows a ``swap_in`` (it could reuse a CPU block not yet read); (b) no
``swap_in`` follows a copy-on-write *and* a later ``free``/``swap_out`` (it could overwrite a freed
block that the copy still reads); (c) no sequence is swapped out after ``append_slots`` was called
for it (its fresh copy-on-write block would be saved before it is filled).
"""
from __future__ import annotations

from dataclasses import dataclass

from offline_paged.core.allocator import BlockAllocator, BlockId, ContentId


@dataclass(slots=True)
class _SeqBlocks:
    """One sequence's blocks. ``block_table`` holds GPU ids, or CPU ids while ``swapped``."""

    block_table: list[BlockId]
    num_slots: int  # token positions with a reserved slot; see BlockManager for len(block_table)
    swapped: bool = False
    num_registered: int = 0  # leading full blocks already offered to the prefix cache
    last_content_id: ContentId | None = None  # content id of block num_registered - 1


class BlockManager:
    """Maps sequences (by id) to block tables in a shared GPU pool; a CPU pool receives swaps.

    Data structures: a dict ``seq_id -> _SeqBlocks`` whose ``block_table`` is a plain list
    (logical block i -> physical block id); the allocators own ref counts and the prefix cache.

    Contiguous layout (``reserve_tokens`` set): the baseline paging is measured against. ``allocate``
    gives a sequence blocks for ``max(len(prompt), reserve_tokens)`` positions at once (what a
    max-length reservation costs), ``can_allocate`` counts all of them, and growth finds its blocks
    already there. A fork shares the whole reservation; a write into a shared block first takes a
    private one (copied only when the block already holds positions of the sequence).

    Invariants (checked by tests/test_block_manager.py): every GPU block's ref count equals the
    number of table entries pointing at it; ``len(table) == ceil(max(num_slots, reserve_tokens) / B)``
    (reserve_tokens = 0 for the paged layout); the
    slot of position p is ``table[p // B] * B + p % B``; a block that is shared (ref > 1) is only
    ever written after a copy-on-write; only full, computed blocks are in the prefix cache.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int = 16,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        reserve_tokens: int | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        self.gpu_allocator = BlockAllocator(num_gpu_blocks)
        self.cpu_allocator = BlockAllocator(num_cpu_blocks)
        self.block_size = block_size
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        if reserve_tokens is not None and (isinstance(reserve_tokens, bool)
                                           or not isinstance(reserve_tokens, int) or reserve_tokens < 1):
            raise ValueError(f"reserve_tokens must be a positive int or None, got {reserve_tokens!r}")
        self.reserve_tokens = reserve_tokens or 0  # 0: paged (blocks on demand)
        self._seqs: dict[int, _SeqBlocks] = {}
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_prefix_hit_tokens = 0
        self.num_prompt_tokens = 0
        self._num_swapped = 0

    # ---- queries --------------------------------------------------------------------------

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu_allocator.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free GPU blocks, counting cached-but-free (revivable, evictable) ones."""
        return self.gpu_allocator.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.num_free_blocks

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[BlockId]:
        """The GPU block table of a resident sequence.

        Returns the manager's own list (no copy, so a whole batch exports in microseconds).
        Callers must not mutate it and must re-fetch it after any call that changes the sequence.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or seq.swapped:
            self._resident(seq_id)  # raises the right ValueError
        return seq.block_table

    def cpu_block_table(self, seq_id: int) -> list[BlockId]:
        """The CPU block table of a swapped-out sequence (same no-copy rule as ``block_table``)."""
        return self._swapped_out(seq_id).block_table

    def num_slots(self, seq_id: int) -> int:
        """Token positions of the sequence that have a reserved slot."""
        return self._get(seq_id).num_slots

    def num_registered_blocks(self, seq_id: int) -> int:
        """Leading full blocks of the sequence already offered to the prefix cache (``mark_computed``)."""
        return self._get(seq_id).num_registered

    def is_swapped(self, seq_id: int) -> bool:
        return self._get(seq_id).swapped

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_reserved_blocks_for(self, num_tokens: int) -> int:
        """Blocks a new sequence of ``num_tokens`` takes at admission (its reservation)."""
        return self.num_blocks_for(max(num_tokens, self.reserve_tokens))

    @property
    def utilization(self) -> float:
        """Token slots in use / token slots allocated, over the GPU pool (0.0 when nothing is allocated).

        Allocated = distinct GPU blocks held by resident sequences × block_size. In use = distinct
        slots that some resident sequence has reserved: a shared block counts once, with the fill of
        its fullest holder (so forked sequences don't count their common prefix twice). Free cached
        blocks are not allocated. O(total table entries); meant for stats, not the hot path.
        """
        bs = self.block_size
        fill: dict[BlockId, int] = {}
        for seq in self._seqs.values():
            if seq.swapped:
                continue
            for i, block_id in enumerate(seq.block_table):
                used = min(bs, max(seq.num_slots - i * bs, 0))  # 0 for a reserved, empty block
                if used >= fill.get(block_id, 0):
                    fill[block_id] = used
        return sum(fill.values()) / (len(fill) * bs) if fill else 0.0

    def slot_utilization(self) -> float:
        """``utilization`` without the walk over whole tables: O(resident sequences), for every step's stats.

        Blocks held = pool - free (free counts cached-but-free blocks, which are not held). A table entry
        before index num_slots // B is full. The other entries ("tails"; one per sequence in the paged layout)
        may be part-filled; a shared block takes the fill of its fullest holder, so a tail block is counted
        part-filled only when every one of its references (its ref count) is a tail entry, and then with
        the largest tail fill. An unshared tail block (the usual case) is therefore counted at once.
        """
        held = self.gpu_allocator.num_blocks - self.gpu_allocator.num_free_blocks
        if held == 0:
            return 0.0
        bs, is_shared = self.block_size, self.gpu_allocator.is_shared
        empty = 0  # reserved-but-empty slots of held blocks
        shared_tails: dict[BlockId, list[int]] = {}  # block id -> [largest fill among tail entries, tail entries]
        for seq in self._seqs.values():
            if seq.swapped:
                continue
            table, num_slots = seq.block_table, seq.num_slots
            for i in range(num_slots // bs, len(table)):
                block_id, fill = table[i], max(num_slots - i * bs, 0)
                if not is_shared(block_id):  # its one reference is this tail entry
                    empty += bs - fill
                    continue
                entry = shared_tails.get(block_id)
                if entry is None:
                    shared_tails[block_id] = [fill, 1]
                else:
                    entry[0], entry[1] = max(entry[0], fill), entry[1] + 1
        ref_count = self.gpu_allocator.ref_count
        empty += sum(bs - fill for block_id, (fill, count) in shared_tails.items() if count == ref_count(block_id))
        return (held * bs - empty) / (held * bs)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens admitted."""
        return self.num_prefix_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    # ---- admission ------------------------------------------------------------------------

    def can_ever_allocate(self, num_tokens: int) -> bool:
        """False when a prompt of this length can't be admitted even into an empty pool."""
        return self.num_reserved_blocks_for(num_tokens) <= self.num_gpu_blocks - self.watermark_blocks

    def can_allocate(self, token_ids: list[int]) -> bool:
        """Whether ``allocate`` would succeed and still leave ``watermark_blocks`` free.

        Counts prefix-cache hits exactly: a hit on a block in use costs nothing, a hit that
        revives a free cached block costs one free block like a fresh allocation.
        """
        free = self.gpu_allocator.num_free_blocks
        reserved = self.num_reserved_blocks_for(len(token_ids))
        if free - reserved >= self.watermark_blocks:
            return True  # fits even with no cache hit: skip the hashing
        extra = reserved - self.num_blocks_for(len(token_ids))  # reservation beyond the prompt
        return free - self._blocks_needed(token_ids) - extra >= self.watermark_blocks

    def allocate(self, seq_id: int, token_ids: list[int]) -> int:
        """Give a new sequence slots for all of ``token_ids``, reusing cached full prefix blocks.

        Returns how many leading tokens already have KV (a multiple of block_size, at most
        ``len(token_ids) - 1``: the block holding the last prompt token is never a hit, so a hit
        is never written). Raises ``ValueError`` for an existing seq id, an empty prompt, or when
        the pool cannot hold the prompt (the watermark is not applied here; see can_allocate).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks; free it before reallocating")
        if not token_ids:
            raise ValueError(f"sequence {seq_id!r}: cannot allocate an empty prompt")
        gpu = self.gpu_allocator
        num_blocks = self.num_reserved_blocks_for(len(token_ids))
        extra = num_blocks - self.num_blocks_for(len(token_ids))
        if gpu.num_free_blocks < num_blocks and gpu.num_free_blocks < self._blocks_needed(token_ids) + extra:
            raise ValueError(
                f"sequence {seq_id!r}: {len(token_ids)} tokens need more than the "
                f"{gpu.num_free_blocks} free blocks (check can_allocate first)"
            )
        table, last_content_id = self._take_cached_prefix(token_ids)
        num_cached_blocks = len(table)
        for _ in range(num_blocks - num_cached_blocks):
            table.append(gpu.allocate())
        self._seqs[seq_id] = _SeqBlocks(
            table, len(token_ids), num_registered=num_cached_blocks, last_content_id=last_content_id
        )
        num_cached_tokens = num_cached_blocks * self.block_size
        self.num_prefix_hit_tokens += num_cached_tokens
        self.num_prompt_tokens += len(token_ids)
        return num_cached_tokens

    # ---- growth ---------------------------------------------------------------------------

    def can_append_slots(self, seq_id: int, num_tokens: int = 1) -> bool:
        """Whether ``append_slots`` would find enough free blocks (the watermark may be used)."""
        seq = self._resident(seq_id)
        return self.gpu_allocator.num_free_blocks >= self._append_cost(seq, num_tokens)

    def append_slots(self, seq_id: int, num_tokens: int = 1) -> list[tuple[BlockId, BlockId]]:
        """Reserve slots for ``num_tokens`` more positions of a resident sequence.

        Allocates a block at each boundary crossed. If the partly filled tail block that the first
        new position lands in is shared (ref > 1), it is replaced by a private block first and the
        ``(src, dst)`` pair is returned for the runner to copy. Raises ``ValueError`` when the pool
        cannot supply the blocks (check ``can_append_slots``); nothing changes in that case.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or seq.swapped:
            self._resident(seq_id)  # raises the right ValueError
        index = seq.num_slots // self.block_size  # the block the next position lands in
        if num_tokens == 1 and index < len(seq.block_table):
            # Decode fast path: the next slot's block is held (the paged tail, or a reserved
            # block); fine unless it is shared.
            if not self.gpu_allocator.is_shared(seq.block_table[index]):
                seq.num_slots += 1
                return []
        return self._append_slots(seq_id, seq, num_tokens)

    def try_append_slots(self, seq_id: int, num_tokens: int = 1) -> list[tuple[BlockId, BlockId]] | None:
        """``append_slots`` if the pool can supply it now, else None (nothing changes): the
        scheduler's one call per sequence per step (the decode fast path checks nothing twice)."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.swapped:
            self._resident(seq_id)  # raises the right ValueError
        index = seq.num_slots // self.block_size
        if num_tokens == 1 and index < len(seq.block_table) and not self.gpu_allocator.is_shared(seq.block_table[index]):
            seq.num_slots += 1
            return []
        if self.gpu_allocator.num_free_blocks < self._append_cost(seq, num_tokens):
            return None
        return self._append_slots(seq_id, seq, num_tokens)

    def _append_slots(
        self, seq_id: int, seq: _SeqBlocks, num_tokens: int
    ) -> list[tuple[BlockId, BlockId]]:
        gpu = self.gpu_allocator
        needed = self._append_cost(seq, num_tokens)
        if gpu.num_free_blocks < needed:
            raise ValueError(
                f"sequence {seq_id!r}: {num_tokens} more tokens need {needed} blocks, "
                f"{gpu.num_free_blocks} free (check can_append_slots first)"
            )
        table = seq.block_table
        copies: list[tuple[BlockId, BlockId]] = []
        for i in self._held_blocks_written(seq, num_tokens):
            if gpu.is_shared(table[i]):
                src = table[i]
                dst = gpu.allocate()
                gpu.free(src)
                table[i] = dst
                if i * self.block_size < seq.num_slots:  # it holds earlier positions: copy them
                    copies.append((src, dst))
                    self.num_cow_copies += 1
        seq.num_slots += num_tokens
        for _ in range(self.num_blocks_for(seq.num_slots) - len(table)):
            table.append(gpu.allocate())
        return copies

    def mark_computed(self, seq_id: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Record that the KV of positions ``0 .. num_computed_tokens - 1`` now exists.

        ``token_ids`` is the sequence's whole token history (at least ``num_computed_tokens`` long).
        Full blocks among the computed positions enter the prefix cache, in order, once each; a
        block whose content is already cached elsewhere stays a private duplicate.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or seq.swapped:
            self._resident(seq_id)  # raises the right ValueError
        if not 0 <= num_computed_tokens <= seq.num_slots or num_computed_tokens > len(token_ids):
            raise ValueError(
                f"sequence {seq_id!r}: num_computed_tokens={num_computed_tokens} must be within "
                f"0..min(reserved slots {seq.num_slots}, len(token_ids) {len(token_ids)})"
            )
        bs = self.block_size
        num_full = num_computed_tokens // bs
        if not self.enable_prefix_caching or num_full <= seq.num_registered:
            return
        register = self.gpu_allocator.register
        parent = seq.last_content_id
        for i in range(seq.num_registered, num_full):
            parent = register(seq.block_table[i], parent, tuple(token_ids[i * bs : (i + 1) * bs]))
        seq.num_registered = num_full
        seq.last_content_id = parent

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Make the child share every block of the resident parent, the partly filled tail included.

        Fork only when all the parent's reserved slots are computed: the child inherits them.
        """
        parent = self._resident(parent_seq_id)
        if child_seq_id in self._seqs:
            raise ValueError(f"cannot fork into sequence {child_seq_id!r}: it already exists")
        incref = self.gpu_allocator.incref
        for block_id in parent.block_table:
            incref(block_id)
        self._seqs[child_seq_id] = _SeqBlocks(
            list(parent.block_table),
            parent.num_slots,
            num_registered=parent.num_registered,
            last_content_id=parent.last_content_id,
        )

    def free(self, seq_id: int) -> None:
        """Release a sequence (resident or swapped). Tail blocks are freed first so that, among a
        sequence's cached blocks, the LRU evicts the longest prefixes before the shared roots."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}: nothing to free")
        allocator = self.cpu_allocator if seq.swapped else self.gpu_allocator
        if seq.swapped:
            self._num_swapped -= 1
        for block_id in reversed(seq.block_table):
            allocator.free(block_id)

    # ---- swapping -------------------------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        return self.cpu_allocator.num_free_blocks >= len(self._resident(seq_id).block_table)

    def swap_out(self, seq_id: int) -> list[tuple[BlockId, BlockId]]:
        """Move a resident sequence to the CPU pool; returns ``(gpu_id, cpu_id)`` pairs to copy.

        Each swapped sequence gets private CPU copies (blocks it shared stay on the GPU for the
        other holders). Its GPU blocks are released; cached ones stay revivable.
        """
        seq = self._resident(seq_id)
        cpu = self.cpu_allocator
        if cpu.num_free_blocks < len(seq.block_table):
            raise ValueError(
                f"sequence {seq_id!r}: needs {len(seq.block_table)} CPU blocks, "
                f"{cpu.num_free_blocks} free (check can_swap_out first)"
            )
        pairs = [(block_id, cpu.allocate()) for block_id in seq.block_table]
        self._release_gpu_blocks(seq.block_table)
        seq.block_table = [cpu_id for _, cpu_id in pairs]
        seq.swapped = True
        seq.num_registered = 0  # the blocks it gets back are fresh; mark_computed re-registers them
        seq.last_content_id = None
        self._num_swapped += 1
        self.num_swapped_out_blocks += len(pairs)
        return pairs

    def can_swap_in(self, seq_id: int) -> bool:
        """Room for the sequence plus the watermark (waived when no other sequence is resident,
        so a sequence that had grown into the watermark can always come back)."""
        needed = len(self._swapped_out(seq_id).block_table)
        if len(self._seqs) > self._num_swapped:
            needed += self.watermark_blocks
        return self.gpu_allocator.num_free_blocks >= needed

    def swap_in(self, seq_id: int) -> list[tuple[BlockId, BlockId]]:
        """Bring a swapped sequence back; returns ``(cpu_id, gpu_id)`` pairs to copy."""
        seq = self._swapped_out(seq_id)
        gpu = self.gpu_allocator
        if gpu.num_free_blocks < len(seq.block_table):
            raise ValueError(
                f"sequence {seq_id!r}: needs {len(seq.block_table)} GPU blocks, "
                f"{gpu.num_free_blocks} free (check can_swap_in first)"
            )
        pairs = [(cpu_id, gpu.allocate()) for cpu_id in seq.block_table]
        for cpu_id in reversed(seq.block_table):
            self.cpu_allocator.free(cpu_id)
        seq.block_table = [gpu_id for _, gpu_id in pairs]
        seq.swapped = False
        self._num_swapped -= 1
        self.num_swapped_in_blocks += len(pairs)
        return pairs

    # ---- internals ------------------------------------------------------------------------

    def _get(self, seq_id: int) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}: allocate it first")
        return seq

    def _resident(self, seq_id: int) -> _SeqBlocks:
        seq = self._get(seq_id)
        if seq.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in first")
        return seq

    def _swapped_out(self, seq_id: int) -> _SeqBlocks:
        seq = self._get(seq_id)
        if not seq.swapped:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return seq

    def _release_gpu_blocks(self, block_table: list[BlockId]) -> None:
        for block_id in reversed(block_table):
            self.gpu_allocator.free(block_id)

    def _append_cost(self, seq: _SeqBlocks, num_tokens: int) -> int:
        """Free blocks ``append_slots(seq, num_tokens)`` would take (new blocks + a copy-on-write)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        num_new = max(self.num_blocks_for(seq.num_slots + num_tokens) - len(seq.block_table), 0)
        is_shared = self.gpu_allocator.is_shared
        return num_new + sum(is_shared(seq.block_table[i]) for i in self._held_blocks_written(seq, num_tokens))

    def _held_blocks_written(self, seq: _SeqBlocks, num_tokens: int) -> range:
        """Indices of blocks already in the table that positions num_slots .. + num_tokens - 1 land
        in (paged: at most the part-filled tail; contiguous: reserved blocks too)."""
        if not num_tokens:
            return range(0)
        end = min(self.num_blocks_for(seq.num_slots + num_tokens), len(seq.block_table))
        return range(seq.num_slots // self.block_size, end)

    def _prefix_blocks(self, token_ids: list[int]):
        """Yield the token tuples of the full blocks a prompt may hit (never the last token's)."""
        bs = self.block_size
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            yield tuple(token_ids[start : start + bs])

    def _blocks_needed(self, token_ids: list[int]) -> int:
        """Free blocks ``allocate(token_ids)`` takes: fresh blocks plus revived cached ones."""
        gpu = self.gpu_allocator
        needed = self.num_blocks_for(len(token_ids))
        if not self.enable_prefix_caching:
            return needed
        parent = None
        for block_tokens in self._prefix_blocks(token_ids):
            block_id = gpu.find_cached(parent, block_tokens)
            if block_id is None:
                break
            if gpu.ref_count(block_id) > 0:
                needed -= 1  # a hit on a block in use costs no free block
            parent = gpu.content_id(block_id)
        return needed

    def _take_cached_prefix(self, token_ids: list[int]) -> tuple[list[BlockId], ContentId | None]:
        """Take a reference on every leading cached block; returns them and the last content id."""
        table: list[BlockId] = []
        parent = None
        if not self.enable_prefix_caching:
            return table, parent
        gpu = self.gpu_allocator
        for block_tokens in self._prefix_blocks(token_ids):
            block_id = gpu.lookup(parent, block_tokens)
            if block_id is None:
                break
            table.append(block_id)
            parent = gpu.content_id(block_id)
        return table, parent
