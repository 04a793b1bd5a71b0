import random

import pytest

from specfleet.runtime.kv.blocks import BlockManager, OutOfBlocks


def held(bm: BlockManager) -> int:
    return bm.num_blocks - bm.num_free_blocks


def test_allocate_append_truncate_free_counts_are_exact():
    bm = BlockManager(10, 4)
    bm.allocate("a", 5)  # 2 blocks
    assert held(bm) == 2 and bm.num_tokens("a") == 5
    bm.append("a", 3)  # 8 tokens -> still 2 blocks
    assert held(bm) == 2
    bm.append("a", 1)  # 9 -> 3 blocks
    assert held(bm) == 3
    bm.truncate("a", 4)  # back to 1 block
    assert held(bm) == 1 and bm.num_tokens("a") == 4
    bm.truncate("a", 0)
    assert held(bm) == 0
    bm.free("a")
    assert bm.num_free_blocks == 10 and not bm.has("a")
    bm.check_invariant()


def test_slots_follow_block_table():
    bm = BlockManager(4, 2)
    bm.allocate("x", 1)
    bm.allocate("y", 3)
    bm.append("x", 2)
    ids_x = bm.block_ids("x")
    assert [bm.slot("x", p) for p in range(3)] == [ids_x[0] * 2, ids_x[0] * 2 + 1, ids_x[1] * 2]
    assert len(set(ids_x) & set(bm.block_ids("y"))) == 0


def test_out_of_blocks_is_reported_and_leaves_state_untouched():
    bm = BlockManager(3, 4)
    bm.allocate("a", 8)
    assert not bm.can_allocate(5) and bm.can_allocate(4)
    with pytest.raises(OutOfBlocks):
        bm.allocate("b", 5)
    assert not bm.has("b") and bm.num_free_blocks == 1
    assert not bm.can_append("a", 5) and bm.can_append("a", 4)
    with pytest.raises(OutOfBlocks):
        bm.append("a", 5)
    assert bm.num_tokens("a") == 8
    with pytest.raises(ValueError):
        bm.truncate("a", 9)


def test_random_operations_keep_invariant_and_end_empty():
    rng = random.Random(0)
    bm = BlockManager(50, 3)
    live: dict[str, int] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.3 or not live:
            rid, n = f"r{step}", rng.randint(0, 20)
            if bm.can_allocate(n):
                bm.allocate(rid, n)
                live[rid] = n
        elif op < 0.6:
            rid = rng.choice(list(live))
            n = rng.randint(0, 9)
            if bm.can_append(rid, n):
                bm.append(rid, n)
                live[rid] += n
        elif op < 0.85:
            rid = rng.choice(list(live))
            live[rid] = rng.randint(0, live[rid])
            bm.truncate(rid, live[rid])
        else:
            bm.free(live.popitem()[0])
        bm.check_invariant()
        assert held(bm) == sum(bm.blocks_for(n) for n in live.values())
    for rid in list(live):
        bm.free(rid)
    assert bm.num_free_blocks == bm.num_blocks
