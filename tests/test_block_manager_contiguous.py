"""BlockManager with reserve_tokens (the contiguous, max-length-reservation baseline).

Properties: admission takes the whole reservation and can_allocate counts it; growth within the
reservation takes no block; utilization counts reserved empty blocks as allocated; forked samples
share the reservation and get private blocks on write (copied only when they hold data); the paged
layout (reserve_tokens=None) is unchanged; a sequence running past its reservation grows like paged.
"""
import pytest

from offline_paged.core.block_manager import BlockManager
from offline_paged.core.config import EngineConfig

B = 4


def manager(num_blocks=40, reserve=32, **kwargs) -> BlockManager:
    return BlockManager(num_blocks, 8, block_size=B, watermark=0.0, reserve_tokens=reserve, **kwargs)


def ref_counts_match_tables(m: BlockManager) -> bool:
    counts: dict[int, int] = {}
    for seq_id in list(m._seqs):
        if not m.is_swapped(seq_id):
            for block_id in m.block_table(seq_id):
                counts[block_id] = counts.get(block_id, 0) + 1
    return all(m.gpu_allocator.ref_count(b) == n for b, n in counts.items())


def test_allocate_reserves_the_whole_length():
    m = manager()
    m.allocate(0, list(range(5)))
    assert len(m.block_table(0)) == 32 // B
    assert m.num_free_blocks == 40 - 8
    assert m.num_slots(0) == 5


def test_prompt_longer_than_the_reservation_gets_its_own_length():
    m = manager(reserve=8)
    m.allocate(0, list(range(13)))
    assert len(m.block_table(0)) == 4


def test_can_allocate_counts_the_reservation():
    m = manager(num_blocks=20, reserve=32)  # 8 blocks each: two fit, a third does not
    assert m.can_allocate([1])
    m.allocate(0, [1])
    m.allocate(1, [2])
    assert m.num_free_blocks == 4
    assert not m.can_allocate([3])
    paged = BlockManager(20, 0, block_size=B, watermark=0.0)
    paged.allocate(0, [1])
    paged.allocate(1, [2])
    assert paged.can_allocate([3])  # the same prompts cost one block each when paged


def test_can_ever_allocate_refuses_a_reservation_larger_than_the_pool():
    assert not manager(num_blocks=7, reserve=32).can_ever_allocate(1)
    assert manager(num_blocks=8, reserve=32).can_ever_allocate(1)


def test_growth_within_the_reservation_takes_no_block():
    m = manager()
    m.allocate(0, list(range(5)))
    table = list(m.block_table(0))
    free = m.num_free_blocks
    for _ in range(27):
        assert m.can_append_slots(0, 1)
        assert m.append_slots(0, 1) == []
    assert m.block_table(0) == table
    assert m.num_free_blocks == free
    assert m.num_slots(0) == 32


def test_chunked_growth_within_the_reservation_takes_no_block():
    m = manager()
    m.allocate(0, list(range(3)))
    assert m.append_slots(0, 20) == []
    assert m.num_free_blocks == 32
    assert m.num_slots(0) == 23


def test_past_the_reservation_it_grows_block_by_block():
    m = manager(reserve=8)
    m.allocate(0, list(range(8)))
    assert m.num_free_blocks == 38
    m.append_slots(0, 1)
    assert len(m.block_table(0)) == 3
    assert m.num_free_blocks == 37


def test_utilization_counts_reserved_empty_blocks_as_allocated():
    m = manager()
    m.allocate(0, list(range(6)))
    assert m.utilization == pytest.approx(6 / 32)
    m.append_slots(0, 10)
    assert m.utilization == pytest.approx(16 / 32)


def test_fork_shares_the_reservation_and_writes_take_private_blocks():
    m = manager()
    m.allocate(0, list(range(6)))  # blocks 0 (full) and 1 (half) hold data; 2..7 reserved
    m.fork(0, 1)
    assert ref_counts_match_tables(m)
    free = m.num_free_blocks
    parent_table = list(m.block_table(0))
    copies = m.append_slots(1, 1)  # position 6 lands in block 1, which holds positions 4, 5
    assert copies == [(parent_table[1], m.block_table(1)[1])]
    assert m.num_free_blocks == free - 1
    copies = m.append_slots(1, 2)  # positions 7, 8: block 1 (now private) and block 2 (shared, empty)
    assert copies == []  # an empty block needs no copy, only a private block
    assert m.block_table(1)[2] != parent_table[2]
    assert m.num_free_blocks == free - 2
    assert m.block_table(0) == parent_table
    assert ref_counts_match_tables(m)


def test_append_cost_counts_shared_reserved_blocks():
    m = manager(num_blocks=9)
    m.allocate(0, list(range(4)))
    m.fork(0, 1)
    assert m.num_free_blocks == 1
    assert m.can_append_slots(1, 4)  # one shared, empty block to replace
    assert not m.can_append_slots(1, 5)  # two of them


def test_free_and_swap_round_trip_keep_the_reservation():
    m = manager(num_blocks=20)
    m.allocate(0, list(range(5)))
    pairs = m.swap_out(0)
    assert len(pairs) == 8
    assert m.num_free_blocks == 20
    assert len(m.swap_in(0)) == 8
    assert m.num_free_blocks == 12
    m.free(0)
    assert m.num_free_blocks == 20


def test_prefix_cache_hits_still_reserve_the_rest():
    m = manager(num_blocks=40)
    prompt = list(range(10))
    m.allocate(0, prompt)
    m.mark_computed(0, prompt, 10)
    assert m.allocate(1, prompt) == 8  # two full cached blocks reused
    assert len(m.block_table(1)) == 8
    assert m.block_table(1)[:2] == m.block_table(0)[:2]
    assert m.num_free_blocks == 40 - 8 - 6


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_reserve_tokens_is_validated(bad):
    with pytest.raises(ValueError, match="reserve_tokens"):
        BlockManager(8, 0, reserve_tokens=bad)


def test_paged_layout_is_unchanged():
    m = BlockManager(40, 0, block_size=B, watermark=0.0)
    m.allocate(0, list(range(5)))
    assert len(m.block_table(0)) == 2
    m.append_slots(0, 3)
    assert len(m.block_table(0)) == 2
    m.append_slots(0, 1)
    assert len(m.block_table(0)) == 3


def test_engine_config_validates_kv_layout():
    assert EngineConfig(kv_layout="contiguous").kv_layout == "contiguous"
    with pytest.raises(ValueError, match="kv_layout"):
        EngineConfig(kv_layout="dense")


def test_engine_reserves_max_model_len_in_contiguous_layout():
    from tiny_engine import tiny_model

    from offline_paged.engine import LLMEngine

    engine = LLMEngine(EngineConfig(device="cpu", kv_layout="contiguous", max_model_len=64,
                                    num_kv_blocks=32, block_size=4), loaded_model=tiny_model())
    assert engine.block_manager.reserve_tokens == 64
    paged = LLMEngine(EngineConfig(device="cpu", max_model_len=64, num_kv_blocks=32, block_size=4),
                      loaded_model=tiny_model())
    assert paged.block_manager.reserve_tokens == 0
