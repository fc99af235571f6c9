"""BlockManager: a Hypothesis state machine with shadow KV memory, plus ordinary unit tests.

Shadow memory: one Python list per pool with an entry per physical slot. Whenever the test
"computes" position p of a sequence it writes, into the slot the block table names, the sequence's
full token prefix up to p (KV depends on the whole prefix, not only the token). Copy-on-write pairs
and swaps returned by the manager copy whole blocks of shadow. The central invariant: every live
sequence reads back, through its block table, exactly its own history at every computed position.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from offline_paged.core.block_manager import BlockManager

PICK = st.integers(0, 2**16)
MAX_SEQS = 12  # enough for heavy sharing; more only slows the invariants down


def _token_lists(min_size: int, max_size: int) -> st.SearchStrategy[list[int]]:
    """Lists over the alphabet {0, 1, 2}, drawn as two integers instead of one choice per token:
    Hypothesis caps the choices of one run, and fewer choices per step means longer runs."""

    def decode(size_and_code: tuple[int, int]) -> list[int]:
        size, code = size_and_code
        return [code // 3**i % 3 for i in range(size)]

    return st.tuples(st.integers(min_size, max_size), st.integers(0, 3**max_size - 1)).map(decode)


NEW_TOKENS = _token_lists(1, 6)


class _Seq:
    """Model of one sequence: its token history (one entry per reserved slot) and progress."""

    __slots__ = ("tokens", "num_computed", "swapped")

    def __init__(self, tokens: list[int], num_computed: int) -> None:
        self.tokens = tokens
        self.num_computed = num_computed
        self.swapped = False


class BlockManagerMachine(RuleBasedStateMachine):
    num_steps = 0

    @initialize(
        num_gpu_blocks=st.integers(2, 24),
        num_cpu_blocks=st.integers(0, 12),
        block_size=st.sampled_from([1, 2, 3, 4]),
        watermark=st.sampled_from([0.0, 0.0, 0.1, 0.25]),
        prefix_caching=st.sampled_from([True, True, True, False]),
        reserve_tokens=st.sampled_from([None, None, None, None, 5, 12]),  # int: contiguous baseline
    )
    def make_manager(
        self, num_gpu_blocks, num_cpu_blocks, block_size, watermark, prefix_caching, reserve_tokens
    ):
        self.bm = BlockManager(
            num_gpu_blocks, num_cpu_blocks, block_size, watermark, prefix_caching, reserve_tokens
        )
        self.reserve = reserve_tokens or 0
        self.bs = block_size
        self.gpu_mem: list = [None] * (num_gpu_blocks * block_size)
        self.cpu_mem: list = [None] * (num_cpu_blocks * block_size)
        self.seqs: dict[int, _Seq] = {}
        self.prompts: list[list[int]] = [[0, 1, 2, 0, 1, 2, 0, 1]]  # sources of shared prefixes
        self.next_id = 0

    def _count_step(self) -> None:
        type(self).num_steps += 1

    # ---- helpers ----------------------------------------------------------------------------

    def _pick(self, pick: int, resident: bool | None = None, computed: bool = False) -> int | None:
        ids = [
            s for s, seq in sorted(self.seqs.items())
            if (resident is None or seq.swapped != resident)
            and (not computed or seq.num_computed == len(seq.tokens))
        ]
        return ids[pick % len(ids)] if ids else None

    def _compute(self, seq_id: int, upto: int) -> None:
        """Write KV for positions num_computed..upto-1 into shadow memory, then mark them computed."""
        seq = self.seqs[seq_id]
        table = self.bm.block_table(seq_id)
        for p in range(seq.num_computed, upto):
            self.gpu_mem[table[p // self.bs] * self.bs + p % self.bs] = tuple(seq.tokens[: p + 1])
        seq.num_computed = upto
        self.bm.mark_computed(seq_id, seq.tokens, upto)

    def _copy_block(self, src_mem: list, src: int, dst_mem: list, dst: int) -> None:
        bs = self.bs
        dst_mem[dst * bs : (dst + 1) * bs] = src_mem[src * bs : (src + 1) * bs]

    def _snapshot(self) -> tuple:
        return (
            self.bm.num_free_blocks,
            self.bm.num_free_cpu_blocks,
            {s: list(self._table(s)) for s in self.seqs},
            {s: self.bm.num_slots(s) for s in self.seqs},
        )

    def _table(self, seq_id: int) -> list[int]:
        if self.seqs[seq_id].swapped:
            return self.bm.cpu_block_table(seq_id)
        return self.bm.block_table(seq_id)

    def _gpu_holders(self, block: int) -> int:
        return sum(
            self.bm.block_table(s).count(block) for s, seq in self.seqs.items() if not seq.swapped
        )

    # ---- rules ------------------------------------------------------------------------------

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(source=PICK, keep=st.integers(0, 12), tail=_token_lists(0, 7), chunk=st.integers(0, 20))
    def allocate(self, source: int, keep: int, tail: list[int], chunk: int) -> None:
        """Admit a prompt (often sharing a prefix with an earlier one) and compute part of it."""
        self._count_step()
        tokens = self.prompts[source % len(self.prompts)][:keep] + tail
        if not tokens:
            return
        seq_id, self.next_id = self.next_id, self.next_id + 1
        admissible = self.bm.can_allocate(tokens)
        evictable_before = set(self.bm.gpu_allocator.evictable_blocks())
        before = None if admissible else self._snapshot()
        try:
            num_cached = self.bm.allocate(seq_id, tokens)
        except ValueError as error:
            event("allocate refused: pool too full")
            assert not admissible, f"can_allocate said yes, allocate raised {error}"
            assert "check can_allocate first" in str(error)
            assert self._snapshot() == before, "a refused allocate must change nothing"
            return
        # can_allocate is exact: yes <=> allocating leaves at least the watermark free.
        assert admissible == (self.bm.num_free_blocks >= self.bm.watermark_blocks)
        assert 0 <= num_cached <= len(tokens) - 1 and num_cached % self.bs == 0
        if not self.bm.enable_prefix_caching:
            assert num_cached == 0
        hit_blocks = self.bm.block_table(seq_id)[: num_cached // self.bs]
        if num_cached:
            event("prefix-cache hit")
        if evictable_before.intersection(hit_blocks):
            event("revival of a freed cached block")
        if evictable_before - set(hit_blocks) - set(self.bm.gpu_allocator.evictable_blocks()):
            event("eviction of a freed cached block")
        self.seqs[seq_id] = _Seq(list(tokens), num_cached)
        self.prompts.append(list(tokens))
        self._compute(seq_id, min(len(tokens), num_cached + chunk))

    @precondition(lambda self: any(s.num_computed < len(s.tokens) and not s.swapped
                                   for s in self.seqs.values()))
    @rule(pick=PICK, chunk=st.integers(1, 9))
    def compute_chunk(self, pick: int, chunk: int) -> None:
        """Chunked prefill / decode: compute the next positions whose slots are reserved."""
        self._count_step()
        pending = [s for s, seq in sorted(self.seqs.items())
                   if not seq.swapped and seq.num_computed < len(seq.tokens)]
        seq_id = pending[pick % len(pending)]
        seq = self.seqs[seq_id]
        self._compute(seq_id, min(len(seq.tokens), seq.num_computed + chunk))

    @precondition(lambda self: any(not s.swapped for s in self.seqs.values()))
    @rule(pick=PICK, new_tokens=NEW_TOKENS, compute=st.booleans())
    def append_tokens(self, pick: int, new_tokens: list[int], compute: bool) -> None:
        """Reserve slots for one or several new tokens, execute the copy-on-write pairs."""
        self._count_step()
        seq_id = self._pick(pick, resident=True, computed=True)
        if seq_id is None:
            return
        seq = self.seqs[seq_id]
        # The block holding both earlier positions and the first new one: copied if shared.
        tail = None
        if len(seq.tokens) % self.bs:
            tail = self.bm.block_table(seq_id)[len(seq.tokens) // self.bs]
        tail_shared = tail is not None and self._gpu_holders(tail) > 1
        possible = self.bm.can_append_slots(seq_id, len(new_tokens))
        before = None if possible else self._snapshot()
        try:
            copies = self.bm.append_slots(seq_id, len(new_tokens))
        except ValueError as error:
            event("append refused: pool dry")
            assert not possible, f"can_append_slots said yes, append_slots raised {error}"
            assert self._snapshot() == before, "a refused append must change nothing"
            return
        assert possible, "can_append_slots said no, but append_slots succeeded"
        assert len(copies) == tail_shared, f"shared tail={tail_shared}, copies={copies}"
        if copies:
            event("copy-on-write")
        for src, dst in copies:
            assert src == tail and self.bm.block_table(seq_id)[len(seq.tokens) // self.bs] == dst
            self._copy_block(self.gpu_mem, src, self.gpu_mem, dst)
        table, bs = self.bm.block_table(seq_id), self.bs
        for index in range(len(seq.tokens) // bs, -(-(len(seq.tokens) + len(new_tokens)) // bs)):
            assert self._gpu_holders(table[index]) == 1, f"block {table[index]} to be written is shared"
        seq.tokens.extend(new_tokens)
        if compute:
            self._compute(seq_id, len(seq.tokens))

    @precondition(lambda self: len(self.seqs) < MAX_SEQS
                  and any(not s.swapped for s in self.seqs.values()))
    @rule(pick=PICK)
    def fork(self, pick: int) -> None:
        """The child shares every block, partial tail included; no copy happens at fork time."""
        self._count_step()
        parent_id = self._pick(pick, resident=True, computed=True)
        if parent_id is None:
            return
        free_before = self.bm.num_free_blocks
        child_id, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent_id, child_id)
        assert self.bm.block_table(child_id) == self.bm.block_table(parent_id)
        assert self.bm.num_free_blocks == free_before
        parent = self.seqs[parent_id]
        self.seqs[child_id] = _Seq(list(parent.tokens), parent.num_computed)

    @precondition(lambda self: bool(self.seqs))
    @rule(pick=PICK)
    def free(self, pick: int) -> None:
        self._count_step()
        seq_id = self._pick(pick)
        table, resident = list(self._table(seq_id)), not self.seqs[seq_id].swapped
        lru_before = self.bm.gpu_allocator.evictable_blocks()
        self.bm.free(seq_id)
        del self.seqs[seq_id]
        assert seq_id not in self.bm
        if resident:
            self._assert_freed_blocks_enter_the_lru_tail_first(table, lru_before)

    def _assert_freed_blocks_enter_the_lru_tail_first(self, table: list[int], lru_before: list[int]) -> None:
        """The documented eviction order: a released sequence's cached blocks join the LRU tail block
        first, so the longest prefix is evicted before the shared head (the root stays hittable)."""
        lru_after = self.bm.gpu_allocator.evictable_blocks()
        joined = lru_after[len(lru_before):]
        allocator = self.bm.gpu_allocator
        cached = {block for block, _, _ in allocator.cached_blocks()}
        expected = [b for b in reversed(table) if allocator.ref_count(b) == 0 and b in cached]
        assert lru_after[:len(lru_before)] == lru_before, "releasing blocks must not reorder the LRU"
        assert joined == expected, (
            f"freed blocks joined the LRU as {joined}; tail first means {expected} (table {table})")

    @precondition(lambda self: any(not s.swapped for s in self.seqs.values()))
    @rule(pick=PICK)
    def swap_out(self, pick: int) -> None:
        self._count_step()
        seq_id = self._pick(pick, resident=True)
        gpu_table = list(self.bm.block_table(seq_id))
        if not self.bm.can_swap_out(seq_id):
            assert self.bm.num_free_cpu_blocks < len(gpu_table)
            before = self._snapshot()
            with pytest.raises(ValueError, match="check can_swap_out first"):
                self.bm.swap_out(seq_id)
            assert self._snapshot() == before
            return
        lru_before = self.bm.gpu_allocator.evictable_blocks()
        pairs = self.bm.swap_out(seq_id)
        event("swap out")
        self._assert_freed_blocks_enter_the_lru_tail_first(gpu_table, lru_before)
        assert [g for g, _ in pairs] == gpu_table
        assert [c for _, c in pairs] == self.bm.cpu_block_table(seq_id)
        for gpu, cpu in pairs:
            self._copy_block(self.gpu_mem, gpu, self.cpu_mem, cpu)
        self.seqs[seq_id].swapped = True

    @precondition(lambda self: any(s.swapped for s in self.seqs.values()))
    @rule(pick=PICK)
    def swap_in(self, pick: int) -> None:
        self._count_step()
        seq_id = self._pick(pick, resident=False)
        cpu_table = list(self.bm.cpu_block_table(seq_id))
        if self.bm.num_free_blocks < len(cpu_table):
            assert not self.bm.can_swap_in(seq_id)
            before = self._snapshot()
            with pytest.raises(ValueError, match="check can_swap_in first"):
                self.bm.swap_in(seq_id)
            assert self._snapshot() == before
            return
        pairs = self.bm.swap_in(seq_id)
        event("swap in")
        assert [c for c, _ in pairs] == cpu_table
        assert [g for _, g in pairs] == self.bm.block_table(seq_id)
        for cpu, gpu in pairs:
            self._copy_block(self.cpu_mem, cpu, self.gpu_mem, gpu)
        seq = self.seqs[seq_id]
        seq.swapped = False
        self.bm.mark_computed(seq_id, seq.tokens, seq.num_computed)  # re-enter the prefix cache

    @precondition(lambda self: any(not s.swapped for s in self.seqs.values()))
    @rule(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(1, 6), swap_in=st.booleans())
    def runner_ordered_step(self, seed: int, num_ops: int, swap_in: bool) -> None:
        """One scheduler step whose copies run in the runner's grouped order, not call order.

        Within the rules in block_manager's docstring: running sequences get slots or are swapped
        out (never one already given slots this step); swap-ins come last, and not after both a
        copy-on-write and a swap-out. Then the runner does every swap-out copy, every swap-in copy,
        every copy-on-write copy, and the forward writes.
        """
        self._count_step()
        rng = random.Random(seed)
        swap_outs, swap_ins, cows, appended = [], [], [], []
        for _ in range(num_ops):
            candidates = [s for s, seq in sorted(self.seqs.items()) if not seq.swapped
                          and seq.num_computed == len(seq.tokens) and s not in appended]
            if not candidates:
                break
            seq_id = rng.choice(candidates)
            num_new = rng.randint(1, 3)
            if self.bm.can_append_slots(seq_id, num_new) and rng.random() < 0.7:
                cows += self.bm.append_slots(seq_id, num_new)
                self.seqs[seq_id].tokens += [rng.randrange(3) for _ in range(num_new)]
                appended.append(seq_id)
            elif self.bm.can_swap_out(seq_id):
                swap_outs += self.bm.swap_out(seq_id)
                self.seqs[seq_id].swapped = True
        if swap_in and not (cows and swap_outs):
            for seq_id, seq in sorted(self.seqs.items()):
                if seq.swapped and self.bm.can_swap_in(seq_id):
                    swap_ins += self.bm.swap_in(seq_id)
                    seq.swapped = False
        for gpu, cpu in swap_outs:
            self._copy_block(self.gpu_mem, gpu, self.cpu_mem, cpu)
        for cpu, gpu in swap_ins:
            self._copy_block(self.cpu_mem, cpu, self.gpu_mem, gpu)
        for src, dst in cows:
            self._copy_block(self.gpu_mem, src, self.gpu_mem, dst)
        for seq_id in appended:
            self._compute(seq_id, len(self.seqs[seq_id].tokens))
        if cows and (swap_outs or swap_ins):
            event("runner-ordered step mixing copy-on-write and swaps")

    @precondition(lambda self: self.bm.num_free_blocks == 0 and bool(self.seqs))
    @rule()
    def pool_dry_refuses_growth_then_free_everything(self) -> None:
        """With the pool dry no admission fits; freeing every sequence returns every block."""
        self._count_step()
        event("pool ran dry")
        assert not self.bm.can_allocate([0] * (self.bs + 1))
        self._free_everything()

    def teardown(self) -> None:
        if hasattr(self, "bm"):
            self._free_everything()

    def _free_everything(self) -> None:
        for seq_id in list(self.seqs):
            self.bm.free(seq_id)
            del self.seqs[seq_id]
        gpu, cpu = self.bm.gpu_allocator, self.bm.cpu_allocator
        assert gpu.num_free_blocks == gpu.num_blocks and cpu.num_free_blocks == cpu.num_blocks
        assert all(gpu.ref_count(b) == 0 for b in range(gpu.num_blocks))
        assert self.bm.utilization == 0.0

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def every_sequence_reads_back_its_own_history(self) -> None:
        for seq_id, seq in self.seqs.items():
            mem = self.cpu_mem if seq.swapped else self.gpu_mem
            table = self._table(seq_id)
            for p in range(seq.num_computed):
                got = mem[table[p // self.bs] * self.bs + p % self.bs]
                assert got == tuple(seq.tokens[: p + 1]), (
                    f"seq {seq_id} position {p}: memory holds {got}, expected its own prefix"
                )

    @invariant()
    def tables_cover_exactly_the_reserved_slots(self) -> None:
        for seq_id, seq in self.seqs.items():
            assert self.bm.num_slots(seq_id) == len(seq.tokens)
            assert len(self._table(seq_id)) == -(-max(len(seq.tokens), self.reserve) // self.bs)
            assert self.bm.is_swapped(seq_id) == seq.swapped

    @invariant()
    def ref_count_equals_table_occurrences(self) -> None:
        for allocator, swapped in ((self.bm.gpu_allocator, False), (self.bm.cpu_allocator, True)):
            counts = [0] * allocator.num_blocks
            for seq_id, seq in self.seqs.items():
                if seq.swapped == swapped:
                    for block in self._table(seq_id):
                        counts[block] += 1
            assert [allocator.ref_count(b) for b in range(allocator.num_blocks)] == counts

    @invariant()
    def free_and_used_partition_the_pools(self) -> None:
        for allocator in (self.bm.gpu_allocator, self.bm.cpu_allocator):
            free = allocator.free_block_ids()
            assert len(free) == len(set(free)), f"a block is twice on a free list: {free}"
            used = {b for b in range(allocator.num_blocks) if allocator.ref_count(b) > 0}
            assert used.isdisjoint(free) and len(used) + len(free) == allocator.num_blocks

    @invariant()
    def cached_blocks_are_full_computed_and_hold_their_tokens(self) -> None:
        bs = self.bs
        for block, _, tokens in self.bm.gpu_allocator.cached_blocks():
            assert len(tokens) == bs
            stored = self.gpu_mem[block * bs : (block + 1) * bs]
            assert all(s is not None for s in stored), f"cached block {block} was never computed"
            assert tuple(s[-1] for s in stored) == tokens, f"cached block {block} lost its tokens"

    @invariant()
    def utilization_matches_a_direct_count(self) -> None:
        fill: dict[int, int] = {}
        for seq_id, seq in self.seqs.items():
            if seq.swapped:
                continue
            for i, block in enumerate(self.bm.block_table(seq_id)):
                used = max(0, min(self.bs, len(seq.tokens) - i * self.bs))  # 0: reserved, empty
                fill[block] = max(fill.get(block, 0), used)
        expected = sum(fill.values()) / (len(fill) * self.bs) if fill else 0.0
        assert self.bm.utilization == pytest.approx(expected, rel=1e-12)


TestBlockManagerMachine = BlockManagerMachine.TestCase
# Hypothesis caps the choices one run may make, which ends runs after roughly 250-500 steps; twice
# the profile's examples keeps the CI total above 100k rule steps (the summary line prints it).
TestBlockManagerMachine.settings = settings(max_examples=2 * settings.default.max_examples)


# ---- ordinary unit tests ------------------------------------------------------------------------


def _admitted(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """Allocate and compute a whole prompt, as the scheduler and runner would."""
    num_cached = bm.allocate(seq_id, tokens)
    bm.mark_computed(seq_id, tokens, len(tokens))
    return num_cached


def test_prefix_hits_stop_before_the_block_of_the_last_token() -> None:
    bm = BlockManager(16, 0, block_size=4)
    prompt = list(range(12))  # exactly three full blocks
    assert _admitted(bm, 1, prompt) == 0
    assert bm.allocate(2, prompt) == 8  # the third block holds the last token: computed again
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2]
    assert bm.block_table(2)[2] != bm.block_table(1)[2]
    assert bm.allocate(3, prompt + [99]) == 12
    assert bm.allocate(4, [5] + prompt[1:]) == 0  # differs in the first block: nothing shared
    assert bm.prefix_cache_hit_rate == pytest.approx(20 / 49)


def test_half_computed_prefill_is_not_a_cache_hit() -> None:
    bm = BlockManager(16, 0, block_size=4)
    prompt = list(range(10))
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 5)  # chunked prefill: only the first block is full and computed
    assert bm.allocate(2, prompt) == 4


def test_freed_prompt_is_revived_until_its_blocks_are_reused() -> None:
    bm = BlockManager(4, 0, block_size=2, watermark=0.0)
    _admitted(bm, 1, [1, 2, 3, 4, 5])
    bm.free(1)
    assert bm.num_free_blocks == 4
    assert bm.allocate(2, [1, 2, 3, 4, 9]) == 4  # revived from the free list
    bm.free(2)
    _admitted(bm, 3, [7, 7, 7, 7, 7, 7, 7, 7])  # needs the whole pool: evicts every cached block
    bm.free(3)
    assert bm.allocate(4, [1, 2, 3, 4, 5]) == 0


def test_can_allocate_keeps_the_watermark_and_counts_hits() -> None:
    bm = BlockManager(10, 0, block_size=2, watermark=0.2)  # 2 blocks held back for growth
    assert bm.watermark_blocks == 2
    assert bm.can_allocate([0] * 16) and not bm.can_allocate([0] * 17)
    _admitted(bm, 1, list(range(13)))  # 7 blocks, 3 left
    shared = list(range(12)) + [50, 51, 52]  # 6 cached blocks in use + 2 new blocks
    assert bm.can_allocate(shared) is False  # 3 free - 2 new = 1 < watermark 2
    assert bm.can_allocate(list(range(12)) + [50])  # 1 new block: 2 left, watermark kept
    assert not bm.can_ever_allocate(17) and bm.can_ever_allocate(16)


def test_fork_then_append_copies_only_the_written_tail_block() -> None:
    bm = BlockManager(8, 0, block_size=4)
    _admitted(bm, 1, [1, 2, 3, 4, 5, 6])
    bm.fork(1, 2)
    parent_table = list(bm.block_table(1))
    assert bm.block_table(2) == parent_table and bm.num_free_blocks == 6
    copies = bm.append_slots(2, 1)
    assert copies == [(parent_table[1], bm.block_table(2)[1])]
    assert bm.block_table(2)[0] == parent_table[0]  # the full block stays shared
    assert bm.append_slots(1, 1) == []  # the parent is now the tail's only holder
    assert bm.num_cow_copies == 1


def test_append_across_several_blocks_at_once() -> None:
    bm = BlockManager(8, 0, block_size=4)
    bm.allocate(1, [1, 2, 3])
    assert bm.append_slots(1, 10) == [] and bm.num_slots(1) == 13
    assert len(bm.block_table(1)) == 4
    assert bm.append_slots(1, 0) == [] and len(bm.block_table(1)) == 4


def test_swap_out_and_in_round_trip() -> None:
    bm = BlockManager(4, 4, block_size=2)
    _admitted(bm, 1, [1, 2, 3])
    gpu_table = list(bm.block_table(1))
    out = bm.swap_out(1)
    assert [g for g, _ in out] == gpu_table and bm.is_swapped(1)
    assert bm.num_free_blocks == 4 and bm.num_free_cpu_blocks == 2
    with pytest.raises(ValueError, match="swapped out; swap it in first"):
        bm.append_slots(1, 1)
    back = bm.swap_in(1)
    assert [c for c, _ in back] == [c for _, c in out]
    assert bm.block_table(1) == [g for _, g in back] and bm.num_free_cpu_blocks == 4


def test_swap_in_waives_the_watermark_only_when_nothing_else_is_resident() -> None:
    bm = BlockManager(10, 10, block_size=1, watermark=0.2)
    bm.allocate(1, list(range(9)))
    bm.allocate(2, [0])
    bm.swap_out(1)
    assert not bm.can_swap_in(1)  # 9 free, needs 9 + watermark 2 while seq 2 is resident
    bm.free(2)
    assert bm.can_swap_in(1)


def test_utilization_counts_shared_blocks_once() -> None:
    bm = BlockManager(8, 0, block_size=4)
    assert bm.utilization == 0.0
    _admitted(bm, 1, [1, 2, 3, 4, 5])  # blocks: 4/4 and 1/4
    assert bm.utilization == pytest.approx(5 / 8)
    bm.fork(1, 2)
    assert bm.utilization == pytest.approx(5 / 8)
    bm.append_slots(2, 2)  # seq 2 gets its own tail: 4 + 1 + 3 slots over 3 blocks
    assert bm.utilization == pytest.approx(8 / 12)


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(8, 0, block_size=2, enable_prefix_caching=False)
    _admitted(bm, 1, [1, 2, 3, 4, 5])
    assert bm.allocate(2, [1, 2, 3, 4, 5]) == 0
    assert bm.gpu_allocator.num_cached_blocks == 0


def test_misuse_messages() -> None:
    bm = BlockManager(4, 1, block_size=2)
    for call in (lambda: bm.block_table(7), lambda: bm.free(7), lambda: bm.append_slots(7, 1),
                 lambda: bm.fork(7, 8), lambda: bm.swap_out(7), lambda: bm.swap_in(7)):
        with pytest.raises(ValueError, match="unknown sequence 7"):
            call()
    with pytest.raises(ValueError, match="empty prompt"):
        bm.allocate(1, [])
    bm.allocate(1, [1, 2, 3])
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate(1, [1])
    with pytest.raises(ValueError, match="it already exists"):
        bm.fork(1, 1)
    with pytest.raises(ValueError, match="non-negative int"):
        bm.append_slots(1, -1)
    with pytest.raises(ValueError, match="num_computed_tokens=4"):
        bm.mark_computed(1, [1, 2, 3], 4)
    with pytest.raises(ValueError, match="is not swapped out"):
        bm.swap_in(1)
    with pytest.raises(ValueError, match="check can_swap_out first"):
        bm.swap_out(1)  # 2 blocks, 1 CPU block
    with pytest.raises(ValueError, match="check can_allocate first"):
        bm.allocate(2, [0] * 5)
    bm.append_slots(1, 5)  # fills the pool: 8 slots
    with pytest.raises(ValueError, match="check can_append_slots first"):
        bm.append_slots(1, 1)
    for bad in ({"block_size": 0}, {"watermark": 1.0}, {"watermark": -0.1}):
        with pytest.raises(ValueError, match="block_size must|watermark must"):
            BlockManager(4, 4, **bad)


def test_shared_block_registered_through_two_equivalent_prefix_chains() -> None:
    """Two holders of one block may name its prefix by different content ids (the first chain's
    root was evicted in between); registering it again must not be mistaken for new content."""
    bm = BlockManager(6, 6, block_size=2, watermark=0.0)
    tokens = [1, 2, 3, 4, 5]
    _admitted(bm, 1, tokens)
    bm.swap_out(1)
    bm.swap_in(1)  # fresh blocks, registration starts over
    bm.fork(1, 2)  # the child inherits "nothing registered yet"
    bm.mark_computed(1, tokens, 2)  # block 0 equals the still-cached original: named by its id
    _admitted(bm, 3, [9] * 6)  # takes every free block: evicts the original blocks
    bm.free(3)
    bm.mark_computed(1, tokens, 4)  # block 1 registered under the evicted root's content id
    bm.mark_computed(2, tokens, 4)  # the child names block 0 afresh, then reaches shared block 1
    assert bm.allocate(4, tokens) == 2  # block 0 hits through the child's chain


def test_eviction_takes_the_tail_before_the_head() -> None:
    """Freed tail first: under pressure the LRU drops a finished prompt's last block before its first,
    so a later prompt sharing only the head still hits the cache."""
    bm = BlockManager(4, 0, block_size=2, watermark=0.0)
    prompt = [1, 2, 3, 4, 5, 6]
    bm.allocate(0, prompt)
    bm.mark_computed(0, prompt, len(prompt))
    head, middle, tail = bm.block_table(0)
    bm.free(0)
    assert bm.gpu_allocator.evictable_blocks() == [tail, middle, head]
    bm.allocate(1, [9, 9, 9])  # needs two blocks: the never-cached one and the LRU's first (the tail)
    assert set(bm.block_table(1)) & {head, middle} == set()
    assert _admitted(bm, 2, [1, 2, 7]) == 2  # the head block is still a hit
