"""The block events tell the router what a server's own lower tiers hold (engine/tiers/kv.py ``watch``):
``tiered`` when the first of its tiers lists a block, ``untiered`` when the last one drops it, in the
log's snapshot too; the shared store is never announced."""

from __future__ import annotations

import torch

from engine.kv_events import KvEventLog
from engine.prefix_cache import chain_hashes
from engine.tiers.host import HostTier
from engine.tiers.kv import announce
from tests.engine.test_kv_tiers import BS, A, engine_with, evict_a, tiers_config


def kinds(log: KvEventLog, kind: str) -> list[int]:
    return [h for _, k, h in log.since(0, limit=1 << 20).events if k == kind]


def test_blocks_the_cache_evicts_to_its_host_tier_are_announced_tiered(tiny_model):
    engine = engine_with(tiny_model, tiers_config("host", None))
    log = engine.scheduler.blocks.events
    evict_a(engine, tiny_model)
    a_blocks = chain_hashes(engine.config.cache_salt, A, BS)[: (len(A) - 1) // BS]
    assert set(a_blocks) <= set(kinds(log, "evicted")) and set(a_blocks) <= set(kinds(log, "tiered"))
    snap = log.snapshot()
    assert set(a_blocks) <= set(snap.tiered) and not set(a_blocks) & set(snap.hashes)
    seq = {h: s for s, k, h in log.since(0, limit=1 << 20).events if k == "tiered"}
    evicted_at = {h: s for s, k, h in log.since(0, limit=1 << 20).events if k == "evicted"}
    assert all(evicted_at[h] < seq[h] for h in a_blocks)  # out of the cache, then into the tier
    engine.close()


def test_a_block_two_tiers_hold_is_tiered_once_and_untiered_when_the_last_drops_it():
    log = KvEventLog(epoch="e")
    block = torch.zeros(64, dtype=torch.uint8)
    small, large = HostTier(max_bytes=128, queue_blocks=8), HostTier(max_bytes=1 << 20, queue_blocks=8)

    announce((small, large), log)
    for h in (1, 2):
        small.put(h, block)
        large.put(h, block)
    assert small.drain() and large.drain()
    small.put(3, block)  # the small tier holds two: 1 goes
    small.drain()
    assert kinds(log, "tiered") == [1, 2, 3] and kinds(log, "untiered") == []  # the large one still holds 1
    with large._lock:
        large._forget(1)
    assert kinds(log, "untiered") == [1]
    assert log.snapshot().tiered == [2, 3]
    for t in (small, large):
        t.close()
