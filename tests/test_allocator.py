"""BlockAllocator: a Hypothesis state machine against a plain-Python model, plus error-message tests.

The model keeps the same facts the simplest possible way (dicts, sets, a list for the LRU) and a
shadow "memory": for every block, the full token prefix whose KV it holds. Registration writes the
shadow; a lookup hit must hand back a block whose shadow is exactly the requested prefix.
"""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from offline_paged.core.allocator import BlockAllocator, BlockId

TOKENS = st.tuples(st.integers(0, 2), st.integers(0, 2))  # tiny alphabet: keys collide often
PICK = st.integers(0, 2**16)


class AllocatorMachine(RuleBasedStateMachine):
    """Allocator vs model. Small pools so that running dry, eviction and revival are common."""

    num_steps = 0  # rule steps across all runs (the CI profile promises a floor; see conftest)

    @initialize(num_blocks=st.integers(1, 8))
    def make_pool(self, num_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.refs = {b: 0 for b in range(num_blocks)}
        self.uncached_free = set(range(num_blocks))
        self.lru: list[int] = []  # free cached blocks, least recently freed first
        self.entries: dict[tuple, int] = {}  # (parent cid, tokens) -> block
        self.block_key: dict[int, tuple] = {}
        self.block_cid: dict[int, int] = {}
        self.prefix_of_cid: dict[int, tuple] = {}  # every content id ever issued -> full prefix
        self.shadow: dict[int, tuple] = {}  # block -> full token prefix its KV was computed for
        self.hits = self.queries = 0
        self.fresh = 0

    def _count_step(self) -> None:
        type(self).num_steps += 1

    def used(self) -> list[int]:
        return sorted(b for b, r in self.refs.items() if r > 0)

    def free_blocks(self) -> list[int]:
        return sorted(b for b, r in self.refs.items() if r == 0)

    def _drop_entry(self, block: int) -> None:
        del self.entries[self.block_key.pop(block)]
        del self.block_cid[block]

    # ---- rules ------------------------------------------------------------------------------

    @precondition(lambda self: any(r == 0 for r in self.refs.values()))
    @rule()
    def allocate(self) -> None:
        self._count_step()
        block = self.allocator.allocate()
        if self.uncached_free:
            assert block in self.uncached_free, "should prefer a never-cached free block"
            self.uncached_free.remove(block)
        else:
            assert block == self.lru[0], f"evicted {block}, least recently freed is {self.lru[0]}"
            self.lru.pop(0)
            self._drop_entry(block)
        self.refs[block] = 1
        self.fresh += 1
        self.shadow[block] = ("garbage", self.fresh)  # new block: content undefined until written

    @precondition(lambda self: all(r > 0 for r in self.refs.values()))
    @rule()
    def allocate_from_empty_pool_raises(self) -> None:
        self._count_step()
        assert not self.allocator.can_allocate()
        with pytest.raises(ValueError, match="no free blocks"):
            self.allocator.allocate()

    @precondition(lambda self: any(r > 0 for r in self.refs.values()))
    @rule(pick=PICK)
    def incref(self, pick: int) -> None:
        self._count_step()
        used = self.used()
        block = used[pick % len(used)]
        self.allocator.incref(BlockId(block))
        self.refs[block] += 1

    @precondition(lambda self: any(r > 0 for r in self.refs.values()))
    @rule(pick=PICK)
    def free(self, pick: int) -> None:
        self._count_step()
        used = self.used()
        block = used[pick % len(used)]
        self.allocator.free(BlockId(block))
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.block_key:
                self.lru.append(block)
            else:
                self.uncached_free.add(block)

    @precondition(lambda self: any(r == 0 for r in self.refs.values()))
    @rule(pick=PICK)
    def double_free_and_incref_of_free_block_raise(self, pick: int) -> None:
        self._count_step()
        free = self.free_blocks()
        block = free[pick % len(free)]
        with pytest.raises(ValueError, match="double free"):
            self.allocator.free(BlockId(block))
        with pytest.raises(ValueError, match="is free"):
            self.allocator.incref(BlockId(block))

    def _parent(self, parent_pick: int) -> int | None:
        """None (first block), or any content id ever issued, live or evicted."""
        cids = sorted(self.prefix_of_cid)
        return None if parent_pick == 0 or not cids else cids[parent_pick % len(cids)]

    @precondition(lambda self: any(r > 0 for r in self.refs.values()))
    @rule(pick=PICK, parent_pick=PICK, tokens=TOKENS)
    def write_and_register(self, pick: int, parent_pick: int, tokens: tuple) -> None:
        """A holder fills an uncached block (after `parent`'s prefix), then registers it."""
        self._count_step()
        writable = [b for b in self.used() if b not in self.block_key]
        if not writable:
            return
        block = writable[pick % len(writable)]
        parent = self._parent(parent_pick)
        prefix = (self.prefix_of_cid[parent] if parent is not None else ()) + tokens
        self.shadow[block] = prefix
        cid = self.allocator.register(BlockId(block), parent, tokens)
        key = (parent, tokens)
        if key in self.entries:
            assert cid == self.block_cid[self.entries[key]], "duplicate content must reuse its id"
            assert not self.allocator.is_cached(BlockId(block))
            return
        assert cid not in self.prefix_of_cid, f"content id {cid} was handed out twice"
        self.entries[key] = block
        self.block_key[block] = key
        self.block_cid[block] = cid
        self.prefix_of_cid[cid] = prefix

    @precondition(lambda self: bool(self.entries))
    @rule(pick=PICK, parent_pick=PICK, same_parent=st.booleans())
    def reregister_same_tokens_changes_nothing(
        self, pick: int, parent_pick: int, same_parent: bool
    ) -> None:
        """Holders of a cached block may register it again, possibly naming its prefix through
        another content id: the answer is the existing content id, and no entry changes."""
        self._count_step()
        live = [b for b in sorted(self.block_key) if self.refs[b] > 0]
        if not live:
            return
        block = live[pick % len(live)]
        parent, tokens = self.block_key[block]
        if not same_parent:
            parent = self._parent(parent_pick)
        elsewhere = self.entries.get((parent, tokens))
        expected = self.block_cid[elsewhere if elsewhere is not None else block]
        assert self.allocator.register(BlockId(block), parent, tokens) == expected

    @precondition(lambda self: bool(self.entries))
    @rule(pick=PICK)
    def lookup_cached_content_hits_or_revives(self, pick: int) -> None:
        self._count_step()
        keys = sorted(self.entries, key=repr)
        parent, tokens = keys[pick % len(keys)]
        self._lookup(parent, tokens)

    @rule(parent_pick=PICK, tokens=TOKENS)
    def lookup_any_content(self, parent_pick: int, tokens: tuple) -> None:
        self._count_step()
        self._lookup(self._parent(parent_pick), tokens)

    def _lookup(self, parent: int | None, tokens: tuple) -> None:
        expected = self.entries.get((parent, tokens))
        assert self.allocator.find_cached(parent, tokens) == expected
        got = self.allocator.lookup(parent, tokens)
        self.queries += 1
        assert got == expected, f"lookup({parent}, {tokens}) gave {got}, model says {expected}"
        if got is None:
            return
        self.hits += 1
        wanted = (self.prefix_of_cid[parent] if parent is not None else ()) + tokens
        assert self.shadow[got] == wanted, "a hit must hold exactly the requested prefix's KV"
        if self.refs[got] == 0:
            self.lru.remove(got)  # revival
        self.refs[got] += 1

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_model(self) -> None:
        for block, count in self.refs.items():
            assert self.allocator.ref_count(BlockId(block)) == count, f"block {block}"

    @invariant()
    def free_and_used_partition_the_pool(self) -> None:
        free = self.allocator.free_block_ids()
        assert len(free) == len(set(free)), f"a block is twice on a free list: {free}"
        assert set(free) == set(self.free_blocks())
        assert self.allocator.num_free_blocks == len(free)
        assert self.allocator.num_used_blocks == len(self.used())
        assert self.allocator.num_free_blocks + self.allocator.num_used_blocks == len(self.refs)

    @invariant()
    def evictable_blocks_in_least_recently_freed_order(self) -> None:
        assert self.allocator.evictable_blocks() == self.lru

    @invariant()
    def cache_entries_match_model_and_shadow(self) -> None:
        entries = {(parent, tokens): block for block, parent, tokens in self.allocator.cached_blocks()}
        assert entries == self.entries
        assert self.allocator.num_cached_blocks == len(self.entries)
        for block, cid in self.block_cid.items():
            assert self.allocator.content_id(BlockId(block)) == cid
            assert self.shadow[block] == self.prefix_of_cid[cid], f"block {block} lost its content"

    @invariant()
    def hit_and_query_counters_match(self) -> None:
        assert (self.allocator.num_hits, self.allocator.num_queries) == (self.hits, self.queries)


TestAllocatorMachine = AllocatorMachine.TestCase
# Runs end near the cap on choices per run (~300-500 steps): 1.5x the profile's examples keeps the
# CI total of the two state machines above 100k rule steps (the summary line prints it).
TestAllocatorMachine.settings = settings(max_examples=3 * settings.default.max_examples // 2)


# ---- ordinary unit tests ------------------------------------------------------------------------


def test_fresh_pool_counts_and_order() -> None:
    allocator = BlockAllocator(3)
    assert (allocator.num_free_blocks, allocator.num_used_blocks) == (3, 0)
    assert [allocator.allocate() for _ in range(3)] == [0, 1, 2]
    assert not allocator.can_allocate()
    assert allocator.num_used_blocks == 3


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_pool_size_is_rejected(bad) -> None:
    with pytest.raises(ValueError, match="num_blocks must be a non-negative int"):
        BlockAllocator(bad)


@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, None])
def test_unknown_block_ids_are_rejected(bad) -> None:
    allocator = BlockAllocator(4)
    allocator.allocate()
    for op in (allocator.free, allocator.incref, allocator.ref_count, allocator.content_id):
        with pytest.raises(ValueError, match="unknown block id"):
            op(bad)


def test_empty_pool_message_says_what_to_check() -> None:
    allocator = BlockAllocator(0)
    assert allocator.num_free_blocks == 0 and not allocator.can_allocate()
    with pytest.raises(ValueError, match="check num_free_blocks or can_allocate"):
        allocator.allocate()


def test_register_errors() -> None:
    allocator = BlockAllocator(2)
    with pytest.raises(ValueError, match="cannot register block 0: it is free"):
        allocator.register(BlockId(0), None, (1, 2))
    block = allocator.allocate()
    allocator.register(block, None, (1, 2))
    with pytest.raises(ValueError, match="already cached with other token ids"):
        allocator.register(block, None, (3, 4))
    with pytest.raises(ValueError, match="already cached with other token ids"):
        allocator.register(block, None, (1, 2), extra_key="lora-1")
    with pytest.raises(ValueError, match="not in the prefix cache"):
        allocator.content_id(allocator.allocate())


def test_freed_cached_block_is_revived_until_reused_then_forgotten() -> None:
    allocator = BlockAllocator(2)
    a = allocator.allocate()
    cid = allocator.register(a, None, (7, 7))
    allocator.free(a)
    assert allocator.lookup(None, (7, 7)) == a  # revival
    assert allocator.ref_count(a) == 1
    allocator.free(a)
    other = allocator.allocate()  # the never-cached block goes first
    assert other != a and allocator.lookup(None, (7, 7)) == a
    allocator.free(a)
    allocator.free(other)
    assert allocator.allocate() == other  # uncached free blocks go before any eviction
    assert allocator.find_cached(None, (7, 7)) == a
    assert allocator.allocate() == a  # then the least recently freed cached block is evicted
    assert allocator.find_cached(None, (7, 7)) is None
    assert allocator.find_cached(cid, (1,)) is None
    assert (allocator.num_hits, allocator.num_queries) == (2, 2)


def test_same_tokens_after_different_parents_are_different_content() -> None:
    allocator = BlockAllocator(4)
    roots = [allocator.allocate() for _ in range(2)]
    cid_a = allocator.register(roots[0], None, (1,))
    cid_b = allocator.register(roots[1], None, (2,))
    child = allocator.allocate()
    allocator.register(child, cid_a, (9,))
    assert allocator.find_cached(cid_a, (9,)) == child
    assert allocator.find_cached(cid_b, (9,)) is None
    assert allocator.find_cached(cid_a, (9,), extra_key="lora-1") is None
