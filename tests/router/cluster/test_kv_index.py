"""The block-hash event log (engine/kv_events.py), the router's index of it
(router/cluster/kv_index.py) and the cache_aware policy (router/cluster/policies.py): pure, no processes."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.kv_events import KvEventLog
from engine.prefix_cache import chain_hashes
from router.cluster.kv_index import KvIndex, WorkerKvIndex
from router.cluster.policies import CacheAware
from router.cluster.registry import Worker
from tests.engine.scheduling import make, req, run_to_end
from tests.support.kv_indexes import SALT, index_holding, page, snapshot


def test_the_router_hashes_a_prompt_exactly_as_the_engine_does():
    s = make(num_blocks=8, block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks and one token
    s.add(req("a", prompt, max_tokens=1))
    run_to_end(s)
    held = s.blocks.events.snapshot().hashes
    assert sorted(chain_hashes(SALT, prompt, 4)) == held
    assert chain_hashes(SALT, prompt, 4, cache_salt="tenant") != chain_hashes(SALT, prompt, 4)


def test_the_block_manager_logs_each_hash_stored_and_each_evicted():
    bm = BlockManager(2, 4, KvEventLog(epoch="e1"))
    ids = bm.allocate(2)
    bm.cache(ids[0], 111)
    bm.cache(ids[1], 222)
    bm.cache(ids[1], 222)  # already held: no second event
    bm.free(ids)
    bm.allocate(1)  # evicts the least recently used: 222 (freed first, the table walked from its end)
    p = bm.events.since(0)
    assert (p.epoch, p.oldest, p.last) == ("e1", 1, 3)
    assert p.events == [(1, "stored", 111), (2, "stored", 222), (3, "evicted", 222)]
    assert bm.events.since(2).events == [(3, "evicted", 222)]
    assert bm.events.since(3).events == []
    assert (bm.events.snapshot().seq, bm.events.snapshot().hashes) == (3, [111])


def test_the_index_follows_events_and_answers_matched_tokens():
    log = KvEventLog(epoch="e1")
    idx = WorkerKvIndex()
    assert idx.stale and not idx.apply(page(log, 0))
    idx.load(snapshot(log))
    hashes = chain_hashes(SALT, list(range(1, 13)), 4)
    for h in hashes[:2]:
        log.stored(h)
    assert idx.apply(page(log, idx.seq)) and idx.seq == 2
    assert idx.matched_tokens(hashes) == 8
    log.evicted(hashes[0])
    assert idx.apply(page(log, idx.seq))
    assert (idx.seq, idx.matched_tokens(hashes)) == (3, 0)  # a chain with its first block gone matches nothing
    assert idx.apply(page(log, idx.seq)) and idx.seq == 3  # nothing new


def test_lost_events_empty_the_index_until_a_snapshot_is_loaded():
    log = KvEventLog(capacity=2, epoch="e1")
    idx = WorkerKvIndex()
    idx.load(snapshot(log))
    for h in (1, 2, 3):  # the ring holds only events 2 and 3: event 1 is lost to a reader at seq 0
        log.stored(h)
    p = page(log, 0)
    assert (p.oldest, p.last) == (2, 3)
    assert not idx.apply(p)
    assert idx.stale and idx.hashes == set()
    idx.load(snapshot(log))
    assert (idx.seq, idx.hashes, idx.resyncs) == (3, {1, 2, 3}, 2)
    log.stored(4)
    assert idx.apply(page(log, idx.seq)) and idx.hashes == {1, 2, 3, 4}


def test_a_restarted_server_is_reloaded_from_its_snapshot():
    idx = WorkerKvIndex()
    old = KvEventLog(epoch="e1")
    old.stored(5)
    idx.load(snapshot(old))
    new = KvEventLog(epoch="e2")  # restarted: empty cache, seq from 1 again
    new.stored(6)
    assert not idx.apply(page(new, idx.seq))
    idx.load(snapshot(new))
    assert (idx.epoch, idx.seq, idx.hashes) == ("e2", 1, {6})


def workers(*inflight: int, limit: int | None = 8) -> list[Worker]:
    return [Worker(f"d{i}", "decode", f"u{i}", inflight=n, max_inflight=limit) for i, n in enumerate(inflight)]


def names(ws):
    return [w.name for w in ws]


def test_cache_aware_prefers_the_server_holding_the_prefix_while_load_allows():
    prompt = list(range(1, 34))  # 8 full blocks of 4 before the last token
    policy = CacheAware(index_holding({"d1": 8}, prompt))
    assert names(policy.order(workers(0, 0), prompt)) == ["d1", "d0"]
    assert names(policy.order(workers(0, 6), prompt)) == ["d1", "d0"]  # hit 32/33 - 6/8 > 0
    assert names(policy.order(workers(0, 8), prompt)) == ["d0", "d1"]  # full: 32/33 - 1 < 0


def test_cache_aware_weighs_a_partial_match_against_load():
    prompt = list(range(1, 34))
    policy = CacheAware(index_holding({"d0": 2, "d1": 6}, prompt))
    assert names(policy.order(workers(0, 0), prompt)) == ["d1", "d0"]  # 24 tokens beat 8
    assert names(policy.order(workers(0, 4), prompt)) == ["d0", "d1"]  # 8/33 - 0 > 24/33 - 4/8
    assert names(CacheAware(index_holding({"d0": 2, "d1": 6}, prompt), load_weight=0).order(workers(0, 4), prompt)) == [
        "d1",
        "d0",
    ]  # weight 0: the cache alone decides


def test_cache_aware_with_nothing_cached_or_no_limit_balances_load():
    prompt = list(range(1, 34))
    policy = CacheAware(KvIndex())
    assert names(policy.order(workers(3, 1, 2), prompt)) == ["d1", "d2", "d0"]
    assert names(policy.order(workers(0, 0, 0), prompt)) == ["d0", "d1", "d2"]  # ties: config order
    unlimited = CacheAware(index_holding({"d0": 8}, prompt))
    # no limit: load is the share of this router's requests; d0 holds 32/33 of the prompt and 3 of 4 requests
    assert names(unlimited.order(workers(3, 1, limit=None), prompt)) == ["d0", "d1"]
    assert names(unlimited.order(workers(9, 0, limit=None), prompt)) == ["d1", "d0"]


def test_servers_with_other_block_sizes_are_matched_with_their_own_hashes():
    prompt = list(range(1, 34))
    index = index_holding({"d0": 4}, prompt, block_size=8)  # 32 tokens in blocks of 8
    matched = index.matcher(prompt)
    assert (matched("d0"), matched("d1")) == (32, 0)


def test_blocks_in_a_servers_own_tiers_count_as_held_after_its_cached_run():
    prompt = list(range(1, 30))  # 7 full blocks of 4
    h = chain_hashes(SALT, prompt, 4)
    log = KvEventLog(epoch="e1")
    log.stored(h[0])
    log.stored(h[1])
    log.tiered(h[2])
    log.tiered(h[3])
    log.tiered(h[5])  # past a gap: the engine's chain stops at h[4]
    index = KvIndex()
    index.of("d0").load(snapshot(log))
    assert index.of("d0").tiered == {h[2], h[3], h[5]}
    assert index.matcher(prompt)("d0") == 4 * 4  # two cached blocks, then two from the tiers
    log.untiered(h[3])
    log.tiered(h[0])  # a block both cached and tiered changes nothing
    assert index.of("d0").apply(page(log, index.of("d0").seq))
    assert index.matcher(prompt)("d0") == 3 * 4
    only_tiered = KvEventLog(epoch="e2")
    only_tiered.tiered(h[0])  # a server whose cache lost the prefix but whose disk has it
    index.of("d1").load(snapshot(only_tiered))
    assert index.matcher(prompt)("d1") == 4
