"""Prefix caching in the block manager and scheduler: exact block ids, ref counts, hits."""

import pytest

from engine.block_manager import NO_HASH, BlockManager, block_hash, root_hash
from engine.request import NoCapacityError, RequestStatus
from tests.engine.scheduling import make, plan_shape, req, run_to_end, update

ROOT = root_hash("model|float32")


def refs(s, ids):
    return [s.blocks.blocks[i].ref_count for i in ids]


def test_block_hashes_chain_over_every_earlier_token():
    a = block_hash(ROOT, [1, 2, 3, 4])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(ROOT, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert block_hash(ROOT, [1, 2, 3, 4]) == a
    assert block_hash(root_hash("model|bfloat16"), [1, 2, 3, 4]) != a


def test_cached_block_with_no_owner_counts_as_free_and_is_evicted_last_used_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = bm.allocate(2)
    assert bm.cache(a, 11) and bm.cache(b, 12)
    bm.free([a, b])  # walked from the end: b becomes least recently used
    assert (bm.num_free, bm.num_cached_free) == (4, 2)
    assert bm.match([11, 12, 13]) == [a, b]
    assert bm.allocate(2) == [2, 3]  # plain free blocks before any eviction
    assert bm.allocate(1) == [b] and bm.blocks[b].block_hash == NO_HASH
    assert bm.match([11, 12]) == [a]
    assert bm.evictions == 1
    bm.check_integrity()


def test_taking_a_cached_block_adds_an_owner_and_the_last_owner_returns_it_to_the_cache():
    bm = BlockManager(num_blocks=2, block_size=4)
    (a,) = bm.allocate(1)
    bm.cache(a, 11)
    assert bm.blocks_to_take([a]) == 0  # owned: taking it uses no free block
    bm.take([a])
    assert bm.blocks[a].ref_count == 2
    bm.free([a])
    bm.free([a])
    assert (bm.num_cached_free, bm.blocks_to_take([a])) == (1, 1)
    bm.take([a])
    assert (bm.num_free, bm.blocks[a].ref_count) == (1, 1)
    bm.check_integrity()


def test_a_second_block_with_a_hash_already_cached_stays_uncached():
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = bm.allocate(2)
    assert bm.cache(a, 11)
    assert not bm.cache(b, 11)
    bm.free([a, b])
    assert (bm.num_cached_free, bm.match([11])) == (1, [a])
    bm.check_integrity()


def test_a_request_reuses_the_full_blocks_of_a_running_one_and_shares_them():
    s = make(num_blocks=8, block_size=4)
    s.add(req("a", range(1, 11)))  # 10 tokens: blocks 0, 1 full, 2 partial
    update(s, s.schedule(), {"a": 50})
    s.add(req("b", [*range(1, 9), 60, 61, 62]))  # shares a's first 8 tokens
    plan = s.schedule()
    assert plan_shape(plan) == [("a", 10, 1, True), ("b", 8, 3, True)]
    assert (plan.prefix_queried, plan.prefix_hits) == (11, 8)
    assert s.requests["b"][0].block_ids == [0, 1, 3]
    assert refs(s, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert s.block_counts() == {"free": 4, "reserved": 0, "running": 4}
    s.check_integrity()
    update(s, plan, {"a": 51, "b": 63})  # a computed 11 tokens, b 11: their third blocks are not full
    s.abort("a")
    assert refs(s, [0, 1, 2, 3]) == [1, 1, 0, 1] and s.stats().cached == 0
    s.abort("b")
    assert s.block_counts() == {"free": 8, "reserved": 0, "running": 0}
    assert s.stats().cached == 2  # blocks 0 and 1
    s.check_integrity()


def test_the_last_prompt_token_is_always_computed_so_a_token_is_sampled():
    s = make(num_blocks=8, block_size=4)
    s.add(req("a", range(1, 9), max_tokens=1))  # exactly two blocks
    run_to_end(s)
    s.add(req("b", range(1, 9), max_tokens=1))
    plan = s.schedule()
    assert plan_shape(plan) == [("b", 4, 4, True)]  # block 0 reused, block 1 recomputed
    assert s.requests["b"][0].block_ids == [0, 2]
    s.add(req("c", range(1, 10), max_tokens=1))  # one more token: both blocks reused
    update(s, plan, {"b": 7})
    plan = s.schedule()
    assert plan_shape(plan) == [("c", 8, 1, True)]
    assert s.requests["c"][0].block_ids == [0, 1, 2]  # b's unhashed copy of block 1 was freed
    s.check_integrity()


def test_a_block_being_written_is_never_shared_identical_prompts_at_once_compute_twice():
    s = make(num_blocks=8, block_size=4)
    s.add(req("a", range(1, 10)))
    s.add(req("b", range(1, 10)))
    plan = s.schedule()
    assert plan_shape(plan) == [("a", 0, 9, True), ("b", 0, 9, True)]
    assert (s.requests["a"][0].block_ids, s.requests["b"][0].block_ids) == ([0, 1, 2], [3, 4, 5])
    update(s, plan, {"a": 7, "b": 7})
    assert [s.blocks.blocks[i].block_hash != NO_HASH for i in range(6)] == [True, True, False, False, False, False]
    s.add(req("c", range(1, 10)))
    assert plan_shape(s.schedule())[-1] == ("c", 8, 1, True)
    assert s.requests["c"][0].block_ids[:2] == [0, 1]
    s.check_integrity()


def test_chunked_prefill_makes_each_block_findable_once_its_chunk_is_computed():
    s = make(num_blocks=8, block_size=4, budget=6)
    s.add(req("a", range(1, 14)))
    update(s, s.schedule(), {})  # a: tokens 0..5, block 0 full
    s.add(req("b", range(1, 14)))
    plan = s.schedule()
    assert plan_shape(plan) == [("a", 6, 6, False)]  # b waits: the budget is spent
    update(s, plan, {})
    plan = s.schedule()
    assert plan_shape(plan) == [("a", 12, 1, True), ("b", 12, 1, True)]  # a computed 12 by now: 3 blocks
    assert s.requests["b"][0].block_ids[:3] == s.requests["a"][0].block_ids[:3] == [0, 1, 2]
    s.check_integrity()


def test_eviction_under_pressure_keeps_the_books_straight():
    s = make(num_blocks=6, block_size=4, max_len=64)
    for k in range(5):
        s.add(req(str(k), [k * 10 + i for i in range(1, 13)], max_tokens=4))  # 3 blocks + 1 for decoding
        run_to_end(s)
    assert s.blocks.evictions > 0
    assert s.block_counts() == {"free": 6, "reserved": 0, "running": 0}
    s.add(req("again", [40 + i for i in range(1, 13)], max_tokens=1))  # the latest prompt: still cached
    assert plan_shape(s.schedule()) == [("again", 8, 4, True)]
    s.check_integrity()


def test_a_preempted_request_comes_back_on_its_own_cached_blocks():
    s = make(num_blocks=4, block_size=2)
    s.add(req("a", [1, 2], max_tokens=5))
    s.add(req("b", [3, 4, 5], max_tokens=5))
    update(s, s.schedule(), {"a": 1, "b": 1})  # a -> [0]; b -> [1, 2], 4 tokens
    update(s, s.schedule(), {"a": 2, "b": 2})  # a -> [0, 3]; b computed 4 tokens: [1, 2] full
    plan = s.schedule()  # a needs a 3rd block, none left: b is preempted
    assert plan.preempted == ["b"]
    assert s.stats().cached == 2
    update(s, plan, {"a": 3})
    s.abort("a")
    plan = s.schedule()
    assert plan_shape(plan) == [("b", 4, 1, True)]  # prompt + first output token come from the cache
    assert s.requests["b"][0].block_ids[:2] == [1, 2]
    s.check_integrity()


def test_different_salts_and_disabled_caching_share_nothing():
    s = make(num_blocks=8, block_size=4)
    s.add(req("a", range(1, 10), max_tokens=1, salt="tenant-1"))
    run_to_end(s)
    s.add(req("b", range(1, 10), max_tokens=1, salt="tenant-2"))
    plan = s.schedule()
    assert (plan_shape(plan), plan.prefix_hits) == ([("b", 0, 9, True)], 0)
    off = make(num_blocks=8, block_size=4, prefix_caching=False)
    off.add(req("a", range(1, 10), max_tokens=1))
    run_to_end(off)
    off.add(req("b", range(1, 10), max_tokens=1))
    plan = off.schedule()
    assert (plan_shape(plan), plan.prefix_queried, off.stats().cached) == ([("b", 0, 9, True)], 0, 0)


def test_remote_kv_is_cached_once_admitted():
    s = make(num_blocks=8, block_size=4, mode="decode")
    s.reserve(req("r", range(1, 10)))
    assert s.stats().cached == 0
    s.admit_remote("r", [42])
    s.add(req("x", range(1, 12)))
    assert plan_shape(s.schedule())[-1] == ("x", 8, 3, True)
    s.check_integrity()
    assert s.requests["r"][0].status is RequestStatus.RUNNING


def test_a_reservation_pins_the_cached_prefix_and_counts_what_it_takes_from_free():
    s = make(num_blocks=6, block_size=4, mode="decode")
    s.add(req("a", range(1, 10)))  # blocks 0, 1 full once computed, 2 partial
    update(s, s.schedule(), {"a": 7})
    r = req("r", [*range(1, 9), 40, 41])  # 10 tokens + the first: 3 blocks, 2 of them a's
    assert s.reserve(r) == [0, 1, 3]
    assert (r.num_cached_tokens, refs(s, [0, 1, 3])) == (8, [2, 2, 1])
    assert s.block_counts() == {"free": 2, "reserved": 1, "running": 3}  # shared blocks count as running
    s.abort("a")
    assert s.block_counts() == {"free": 3, "reserved": 3, "running": 0}
    s.check_integrity()
    s.abort("r")
    assert (s.block_counts()["free"], s.stats().cached) == (6, 2)
    # 21 tokens + the first: 6 blocks, 2 of them cached with no owner, so all 6 free blocks are used
    assert s.reserve(req("fits", range(1, 22))) == [0, 1, 2, 3, 4, 5]
    assert (s.block_counts()["free"], s.stats().cached) == (0, 0)
    s.abort("fits")
    with pytest.raises(NoCapacityError):  # 7 blocks needed
        s.reserve(req("big", range(1, 26)))
    assert (s.block_counts()["free"], s.stats().cached, "big" in s.requests) == (6, 2, False)
    s.check_integrity()


# ---- kept tails: a finished request's last, partial block ------------------------------------------------
def test_a_tail_is_kept_taken_by_the_next_turn_and_forgotten_when_evicted():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = bm.allocate(2)
    assert not bm.keep_tail(a, 11, [1, 2, 3, 4])  # a whole block is hashed, not kept as a tail
    assert bm.keep_tail(b, 11, [5, 6])
    bm.free([a, b])
    assert (bm.num_free, bm.num_cached_free, bm.num_tails) == (3, 1, 1)
    assert bm.tail_after(11, [5, 6, 7]) == 2 and bm.tail_after(11, [5, 9]) == 0 and bm.tail_after(12, [5, 6]) == 0
    assert bm.take_tail(11, [5, 7]) is None  # other tokens: nothing taken
    assert bm.take_tail(11, [5, 6, 7]) == (b, 2)
    assert (bm.blocks[b].ref_count, bm.num_tails, bm.num_free) == (1, 0, 2)
    assert bm.take_tail(11, [5, 6, 7]) is None  # the block is the taker's alone now
    bm.check_integrity()
    assert bm.keep_tail(b, 11, [5, 6, 8])
    bm.free([b])
    seq = bm.events.since(0).last
    assert bm.allocate(3) == [a, 2, b]  # free blocks first, the tail last: then it is forgotten
    assert (bm.num_tails, bm.evictions, bm.events.since(0).last) == (0, 0, seq)  # no eviction, no KV event
    bm.check_integrity()


def test_a_newer_tail_after_the_same_chain_replaces_the_older():
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = bm.allocate(2)
    assert bm.keep_tail(a, 11, [5])
    bm.free([a])
    assert bm.keep_tail(b, 11, [6, 7])
    bm.free([b])
    assert (bm.num_tails, bm.num_cached_free, bm.tail_after(11, [6, 7, 8]), bm.tail_after(11, [5, 6])) == (1, 1, 2, 0)
    bm.check_integrity()


def test_the_next_turn_takes_the_answer_s_computed_tokens_and_computes_only_the_new_ones():
    s = make(num_blocks=8, block_size=4)
    s.add(req("t1", range(1, 10), max_tokens=3))  # 9 tokens and 3 answer tokens, 2 of them fed back
    run_to_end(s, token=7)
    assert s.stats().cached == 3 and s.blocks.num_tails == 1  # blocks 0, 1 and the tail [9, 7, 7] of block 2
    s.add(req("t2", [*range(1, 10), 7, 7, 7, 50, 51, 52, 53], max_tokens=1))
    plan = s.schedule()
    assert plan_shape(plan) == [("t2", 11, 5, True)]  # 8 cached tokens, 3 of the tail, the last 5 computed
    assert s.requests["t2"][0].block_ids[:3] == [0, 1, 2]
    assert (plan.prefix_queried, plan.prefix_hits) == (16, 11)
    update(s, plan, {"t2": 7})
    s.check_integrity()
    assert s.block_counts() == {"free": 8, "reserved": 0, "running": 0}


def test_a_reservation_pins_a_kept_tail_and_the_remote_side_writes_after_it():
    s = make(num_blocks=8, block_size=4, mode="decode")
    s.reserve(req("t1", range(1, 10), max_tokens=3))
    s.admit_remote("t1", [7])  # 9 prompt tokens written remotely, the first token drawn there
    run_to_end(s, token=7)  # two more: the first two answer tokens' K/V computed here
    r = req("t2", [*range(1, 10), 7, 7, 7, 50, 51], max_tokens=1)
    assert s.reserve(r) == [0, 1, 2, 3]
    assert r.num_cached_tokens == 11  # 2 blocks and the tail: the remote side writes tokens [11, 14)
    assert s.block_counts() == {"free": 4, "reserved": 4, "running": 0}
    s.abort("t2")  # an aborted request keeps no tail: what it was to write never came
    assert s.blocks.num_tails == 0 and s.block_counts()["free"] == 8
    s.check_integrity()
