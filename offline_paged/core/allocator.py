"""Physical KV block pool: reference counts, free lists and the prefix cache.

Pure Python on purpose (no numpy): Hypothesis drives it directly and the scheduler calls it on the
hot path of every step.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import NewType

BlockId = NewType("BlockId", int)
ContentId = NewType("ContentId", int)
"""Identity of one cached block's *content including its whole prefix*; never reused."""

CacheKey = tuple[ContentId | None, tuple[int, ...], Hashable]


class BlockAllocator:
    """A pool of ``num_blocks`` physical block ids with reference counts and a prefix cache.

    Data structures:
    - ``_ref_counts[b]``: how many holders block ``b`` has; 0 means free.
    - Free blocks live in exactly one of two free lists. ``_free_uncached`` (a stack) holds blocks
      whose content nobody can look up; ``_evictable`` (an ``OrderedDict`` used as an LRU, oldest
      first) holds freed blocks that are still in the prefix cache. ``allocate`` takes uncached
      blocks first, then evicts the least recently freed cached block, dropping its cache entry.
      A lookup that hits an evictable block revives it: O(1) removal from the LRU.
    - ``_cache``: key -> block for every cached block (in use or evictable). The key is
      ``(parent content id, token ids, extra key)``; the dict hashes that tuple (the chained
      content hash) and confirms a hit with ``==``, which compares the token ids themselves, so a
      hash collision can never hand out the wrong KV. The parent is named by its ``ContentId``
      (a serial number handed out at registration and never reused) rather than by its hash: a
      chain of content ids identifies the full token prefix exactly, even across evictions.

    Invariants: free ∪ used is the whole pool and they are disjoint; no id is on a free list twice;
    a block is evictable iff it is free and cached; every cache entry points at a block whose
    ``_keys`` entry is that key.

    Misuse raises ``ValueError``: unknown id, double free, incref of a free block, allocating from
    an empty pool (an empty pool itself is normal: test ``num_free_blocks``/``can_allocate``).
    """

    __slots__ = (
        "num_blocks", "_ref_counts", "_free_uncached", "_evictable", "_cache", "_keys",
        "_content_ids", "_next_content_id", "num_hits", "num_queries",
    )

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        # Reversed so that a fresh pool hands out 0, 1, 2, ... (easier to read in dumps).
        self._free_uncached: list[BlockId] = [BlockId(b) for b in reversed(range(num_blocks))]
        self._evictable: OrderedDict[BlockId, None] = OrderedDict()
        self._cache: dict[CacheKey, BlockId] = {}
        self._keys: list[CacheKey | None] = [None] * num_blocks
        self._content_ids: list[ContentId | None] = [None] * num_blocks
        self._next_content_id = 0
        self.num_hits = 0
        self.num_queries = 0

    # ---- counters -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, in use or free-but-revivable."""
        return len(self._cache)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def can_allocate(self, num_blocks: int = 1) -> bool:
        return self.num_free_blocks >= num_blocks

    def ref_count(self, block_id: BlockId) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_shared(self, block_id: BlockId) -> bool:
        """Whether more than one holder references the block. Hot path: the id is not checked,
        so pass only ids this allocator handed out."""
        return self._ref_counts[block_id] > 1

    # ---- allocate / share / free ----------------------------------------------------------

    def allocate(self) -> BlockId:
        """Take a free block with fresh (undefined) content; its ref count becomes 1.

        Prefers never-cached blocks; otherwise evicts the least recently freed cached block and
        drops its cache entry. Raises ``ValueError`` when the pool is empty.
        """
        if self._free_uncached:
            block_id = self._free_uncached.pop()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(block_id)
        else:
            raise ValueError(
                f"no free blocks: all {self.num_blocks} blocks are in use "
                "(check num_free_blocks or can_allocate() before allocating)"
            )
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: BlockId) -> None:
        """Add a holder to a block in use (sharing). Reviving a free cached block is ``lookup``'s job."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot incref block {block_id}: it is free (allocate or look it up)")
        self._ref_counts[block_id] += 1

    def free(self, block_id: BlockId) -> None:
        """Drop one holder; at zero the block returns to the pool (cached blocks stay revivable)."""
        self._check_id(block_id)
        count = self._ref_counts[block_id]
        if count == 0:
            raise ValueError(f"double free of block {block_id}: it is already free")
        self._ref_counts[block_id] = count - 1
        if count == 1:
            if self._keys[block_id] is None:
                self._free_uncached.append(block_id)
            else:
                self._evictable[block_id] = None

    # ---- prefix cache ---------------------------------------------------------------------

    def find_cached(
        self, parent: ContentId | None, token_ids: tuple[int, ...], extra_key: Hashable = None
    ) -> BlockId | None:
        """The cached block holding ``token_ids`` after the prefix ``parent``, or None. No side effects."""
        return self._cache.get((parent, token_ids, extra_key))

    def lookup(
        self, parent: ContentId | None, token_ids: tuple[int, ...], extra_key: Hashable = None
    ) -> BlockId | None:
        """Like ``find_cached`` but a hit takes a reference (reviving a free block) and counts.

        ``parent`` is the ``content_id`` of the previous block of the prefix (None for the first
        block); ``token_ids`` must be a tuple. Returns None on a miss.
        """
        self.num_queries += 1
        block_id = self._cache.get((parent, token_ids, extra_key))
        if block_id is None:
            return None
        self.num_hits += 1
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1
        return block_id

    def register(
        self,
        block_id: BlockId,
        parent: ContentId | None,
        token_ids: tuple[int, ...],
        extra_key: Hashable = None,
    ) -> ContentId:
        """Record that in-use ``block_id`` holds the full, computed ``token_ids`` after ``parent``.

        Returns the content id of this content, to be passed as ``parent`` for the next block. If
        the same content is already cached (in this or another block) nothing changes and the
        existing content id is returned; the duplicate block stays uncached. If this block is
        already cached with the same token ids under another parent, its holders reached the same
        prefix through two content ids (one chain's root was evicted in between): the block keeps
        its entry and its content id is returned.
        Raises ``ValueError`` if the block is free or already cached with other token ids.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"cannot register block {block_id}: it is free")
        key = (parent, token_ids, extra_key)
        existing = self._cache.get(key)
        if existing is not None:
            return self._content_ids[existing]
        current = self._keys[block_id]
        if current is not None:
            if current[1:] != key[1:]:
                raise ValueError(
                    f"block {block_id} is already cached with other token ids; "
                    "a full block never changes"
                )
            return self._content_ids[block_id]
        content_id = ContentId(self._next_content_id)
        self._next_content_id += 1
        self._cache[key] = block_id
        self._keys[block_id] = key
        self._content_ids[block_id] = content_id
        return content_id

    def content_id(self, block_id: BlockId) -> ContentId:
        """The content id of a cached block (``ValueError`` if the block is not cached)."""
        self._check_id(block_id)
        content_id = self._content_ids[block_id]
        if content_id is None:
            raise ValueError(f"block {block_id} is not in the prefix cache")
        return content_id

    def is_cached(self, block_id: BlockId) -> bool:
        self._check_id(block_id)
        return self._keys[block_id] is not None

    def cached_blocks(self) -> Iterator[tuple[BlockId, ContentId | None, tuple[int, ...]]]:
        """(block, parent content id, token ids) for every cache entry; for checks and debugging."""
        for (parent, token_ids, _), block_id in self._cache.items():
            yield block_id, parent, token_ids

    def evictable_blocks(self) -> list[BlockId]:
        """Free cached blocks, least recently freed (next to be evicted) first."""
        return list(self._evictable)

    def free_block_ids(self) -> list[BlockId]:
        """Every free block id (uncached first, then evictable in LRU order); O(num_free)."""
        return [*reversed(self._free_uncached), *self._evictable]

    # ---- internals ------------------------------------------------------------------------

    def _uncache(self, block_id: BlockId) -> None:
        del self._cache[self._keys[block_id]]
        self._keys[block_id] = None
        self._content_ids[block_id] = None

    def _check_id(self, block_id: BlockId) -> None:
        if not (type(block_id) is int and 0 <= block_id < self.num_blocks):
            raise ValueError(
                f"unknown block id {block_id!r}: valid ids are 0..{self.num_blocks - 1}"
            )
