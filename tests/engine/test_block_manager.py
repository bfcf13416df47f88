"""Block manager: exact ids, ref counts, integrity."""

import pytest

from engine.block_manager import BlockManager


def test_allocation_hands_out_lowest_ids_first_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) == [3, 4]
    bm.free([1, 0])
    assert bm.num_free == 5
    assert bm.allocate(3) == [0, 1, 5]
    bm.check_integrity()


def test_grow_extends_a_table_only_when_a_new_block_is_needed():
    bm = BlockManager(num_blocks=4, block_size=4)
    table: list[int] = []
    assert bm.grow(table, 4) and table == [0]
    assert bm.grow(table, 4) and table == [0]
    assert bm.grow(table, 5) and table == [0, 1]
    assert bm.grow(table, 16) and table == [0, 1, 2, 3]
    assert not bm.grow(table, 17) and table == [0, 1, 2, 3]
    bm.check_integrity()


def test_blocks_needed_rounds_up():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert [bm.blocks_needed(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_over_allocation_and_double_free_are_refused():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(3)
    with pytest.raises(RuntimeError):
        bm.allocate(3)
    ids = bm.allocate(2)
    bm.free(ids)
    with pytest.raises(AssertionError):
        bm.free(ids)


def test_ref_counted_block_is_freed_by_its_last_owner():
    bm = BlockManager(num_blocks=2, block_size=4)
    (block,) = bm.allocate(1)
    bm.blocks[block].ref_count += 1  # a second owner, as prefix sharing would add
    bm.free([block])
    assert bm.num_free == 1
    bm.free([block])
    assert bm.num_free == 2
    bm.check_integrity()
