"""Per-tenant shares of the shared Redis store (engine/tiers/redis_shares.py), on a real Redis server
(tests/redis_server.py, ``maxmemory-policy noeviction``): a tenant writing past its share loses its own oldest
blocks and never another's, a block two tenants write is charged once to the first, a block over the share is
refused, reads keep a tenant's used blocks, keys gone under the accounts are uncharged, a full store refuses
writes without being taken for down, and a store killed is a miss, never an error raised. After every scenario
the store's counters equal the bytes it really holds, block by block. Through an engine: the tenant of the
request that computed a block is the one charged, and another tenant's blocks still serve a second engine, its
tokens equal to transformers'."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import SamplingParams
from engine.config import KvTiersConfig
from engine.prefix_cache import chain_hashes
from engine.tiers.disk import HEADER
from engine.tiers.redis_store import RedisTier
from tests.engine.oracle import hf_greedy
from tests.engine.test_kv_tiers import BS, A, B, C, assert_all_free, engine_with
from tests.redis_server import RedisServer, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

BLOCK = 1024  # payload bytes of a test block
VALUE = HEADER.size + BLOCK  # what the store holds for it, and charges
SHARE = 4 * VALUE


@pytest.fixture
def store():
    server = RedisServer(policy="noeviction")
    yield server
    server.stop()


@pytest.fixture
def tier(store):
    t = RedisTier(store.url, "shares-test", queue_blocks=1024, share_bytes=SHARE)
    yield t
    t.close()


def block(h: int) -> torch.Tensor:
    return torch.full((BLOCK,), h % 251, dtype=torch.uint8)


def write(tier: RedisTier, tenant: str | None, hashes: range | list[int]) -> None:
    for h in hashes:
        assert tier.put(h, block(h), tenant=tenant)
    assert tier.drain(30)


def readable(tier: RedisTier, h: int) -> bool:
    data = tier.get(h)
    return data is not None and torch.equal(data, block(h))


def assert_exact(store: RedisServer, tier: RedisTier) -> dict[str, int]:
    """``accounts_exact`` for ``tier``'s keys; the counters ``tier`` reads are the same."""
    counted = accounts_exact(store, tier.prefix, tier.meta)
    assert tier.tenant_bytes() == counted
    return counted


def accounts_exact(store: RedisServer, prefix: str, meta: str) -> dict[str, int]:
    """Every block key under ``prefix`` is listed, every listed block is there, in its owner's LRU and nobody
    else's, and each tenant's counter under ``meta`` is the sum of its blocks' real sizes; the counters."""
    client = store.client
    listed = {k.decode(): v.decode().split() for k, v in client.hgetall(meta + "blocks").items()}
    keys = {k.decode().rsplit(":", 1)[1] for k in client.scan_iter(prefix + "*")}
    assert keys == set(listed)
    real: Counter[str] = Counter()
    for member, (tenant, size) in listed.items():
        assert client.strlen(prefix + member) == int(size)
        assert client.zscore(meta + "lru:" + tenant, member) is not None
        real[tenant] += int(size)
    for lru in client.scan_iter(meta + "lru:*"):
        tenant = lru.decode().rsplit(":", 1)[1]
        assert {m.decode() for m in client.zrange(lru, 0, -1)} == {m for m, (t, _) in listed.items() if t == tenant}
    counted = {k.decode(): int(v) for k, v in client.hgetall(meta + "bytes").items()}
    assert counted == dict(real)
    return counted


def shares(tier: RedisTier) -> dict[str, tuple[int, int, int]]:
    """Per tenant, as this server's stats say: (bytes held, refused writes, evictions)."""
    return {t.tenant: (t.bytes_held, t.refused_writes, t.evictions) for t in tier.stats().tenants}


def test_a_tenant_writing_past_its_share_evicts_only_its_own_oldest_blocks(store, tier):
    write(tier, "quiet", range(100, 103))
    write(tier, "flood", range(10))  # 10 blocks into a share of 4
    assert [h for h in range(10) if readable(tier, h)] == [6, 7, 8, 9]
    assert all(readable(tier, h) for h in range(100, 103))
    assert assert_exact(store, tier) == {"flood": 4 * VALUE, "quiet": 3 * VALUE}
    assert shares(tier) == {"flood": (4 * VALUE, 0, 6), "quiet": (3 * VALUE, 0, 0)}
    stats = tier.stats()
    assert (stats.evictions, stats.dropped_writes, stats.errors) == (6, 0, 0)
    assert all(t.share == SHARE for t in stats.tenants)


def test_a_block_two_tenants_write_is_charged_once_to_the_first(store, tier):
    write(tier, "first", [1, 2])
    write(tier, "second", [2, 3])
    assert assert_exact(store, tier) == {"first": 2 * VALUE, "second": VALUE}
    write(tier, "second", range(10, 14))  # second's share fills: it evicts its block 3, never first's 2
    assert readable(tier, 2) and not readable(tier, 3)
    assert assert_exact(store, tier) == {"first": 2 * VALUE, "second": 4 * VALUE}


def test_a_block_larger_than_the_share_is_refused_and_counted(store):
    tier = RedisTier(store.url, "shares-small", share_bytes=VALUE - 1)
    try:
        write(tier, "a", [1])
        assert not readable(tier, 1)
        assert assert_exact(store, tier) == {}
        assert shares(tier) == {"a": (0, 1, 0)}
        assert tier.stats().dropped_writes == 1
    finally:
        tier.close()


def test_a_read_keeps_a_block_and_the_least_recently_used_one_goes(store, tier):
    write(tier, "a", range(4))
    assert readable(tier, 0)  # 0 is now the most recently used; 1 the least
    write(tier, "a", [4])
    assert [h for h in range(5) if readable(tier, h)] == [0, 2, 3, 4]
    assert assert_exact(store, tier) == {"a": 4 * VALUE}


def test_blocks_gone_under_the_accounts_are_uncharged_when_next_read_or_written(store, tier):
    write(tier, "a", range(4))
    store.client.delete(tier.key(0), tier.key(1))  # as Redis's own eviction would
    assert not readable(tier, 0)  # the read unlists 0
    write(tier, "a", [1])  # the write unlists 1, then stores it again
    assert assert_exact(store, tier) == {"a": 3 * VALUE}
    write(tier, "a", [5, 6])  # room for both without evicting: 0 and 1's bytes were uncharged
    assert shares(tier)["a"] == (4 * VALUE, 0, 1)
    assert [h for h in range(7) if readable(tier, h)] == [1, 3, 5, 6]
    assert assert_exact(store, tier) == {"a": 4 * VALUE}


def test_a_corrupt_block_is_deleted_and_uncharged_together(store, tier):
    write(tier, "a", range(3))
    value = bytearray(store.client.get(tier.key(1)))
    value[-1] ^= 1
    store.client.set(tier.key(1), bytes(value))
    assert not readable(tier, 1)
    assert tier.stats().corrupt == 1
    assert assert_exact(store, tier) == {"a": 2 * VALUE}


def test_a_full_store_refuses_writes_as_the_tenant_s_without_being_taken_for_down():
    server = RedisServer(max_bytes=3 << 20, policy="noeviction")
    tier = RedisTier(server.url, "shares-full", queue_blocks=1024, share_bytes=64 << 20)
    try:
        big = 64 << 10
        for h in range(80):  # 5 MiB into a 3 MiB server
            assert tier.put(h, torch.full((big,), h % 251, dtype=torch.uint8), tenant="a")
        assert tier.drain(60)
        stats = tier.stats()
        held, refused, evicted = shares(tier)["a"]
        assert refused > 0 and evicted == 0 and stats.errors == 0
        assert held == (80 - refused) * (HEADER.size + big)
        assert assert_exact(server, tier) == {"a": held}
    finally:
        tier.close()
        server.stop()


def test_a_tenant_that_is_not_a_name_is_refused(store, tier):
    assert tier.put(1, block(1), tenant="A B:c")
    assert tier.drain(10)
    assert not readable(tier, 1)
    assert tier.stats().dropped_writes == 1
    assert assert_exact(store, tier) == {}


def test_a_store_killed_under_shares_is_a_miss_and_a_dropped_write_never_an_error_raised():
    server = RedisServer(policy="noeviction")
    tier = RedisTier(server.url, "shares-down", share_bytes=SHARE, timeout_s=0.2, retry_s=0.0)
    try:
        write(tier, "a", [1])
        assert readable(tier, 1)
        server.stop()
        write(tier, "a", [2])
        assert not readable(tier, 1) and not readable(tier, 2)
        stats = tier.stats()
        assert (stats.hits, stats.dropped_writes) == (1, 1) and stats.errors >= 2
        assert shares(tier) == {"a": (VALUE, 0, 0)}  # as last counted; nothing refused for the tenant
    finally:
        tier.close()
        server.stop()


def test_a_name_that_is_no_configured_tenant_is_charged_to_the_default_tenant(store):
    tier = RedisTier(store.url, "shares-known", share_bytes=SHARE, tenants=frozenset({"default", "known"}))
    try:
        write(tier, "known", [1])
        write(tier, "made-up", [2])
        write(tier, None, [3])
        assert all(readable(tier, h) for h in (1, 2, 3))
        assert assert_exact(store, tier) == {"known": VALUE, "default": 2 * VALUE}
        assert set(shares(tier)) == {"known", "default"}  # no label for a made-up name
    finally:
        tier.close()


SAMPLING = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def run_as(engine, path: str, tenant: str, tokens: list[int]) -> None:
    """One greedy request for ``tenant``, checked against transformers; its blocks published on finish."""
    engine.add_request(f"{tenant}-{tokens[0]}", tokens, SAMPLING, tenant=tenant)
    out: list[int] = []
    while engine.has_unfinished():
        for step in engine.step():
            out += step.new_token_ids
    assert out == hf_greedy(path, tokens, 8, ignore_eos=True)
    assert engine.tiers.drain()


def test_the_tenant_whose_request_computed_a_block_is_charged_and_another_s_blocks_still_serve(tiny_model, store):
    """Through an engine: tenant ``flood`` publishes A and B (more than its share of 5 blocks), ``quiet``
    publishes C; a second engine then serves C from the store to ``quiet``, loading its blocks."""
    first = engine_with(tiny_model, KvTiersConfig(redis_url=store.url))  # sized below, once the block's known
    value = HEADER.size + first.tiers.block_nbytes
    first.close()
    tiers = KvTiersConfig(redis_url=store.url, redis_max_bytes_per_tenant=5 * value)
    first = engine_with(tiny_model, tiers)
    try:
        for tokens in (A, B):
            run_as(first, tiny_model, "flood", tokens)
        run_as(first, tiny_model, "quiet", C)
        redis_tier = first.tiers.tiers[0]
        counted = assert_exact(store, redis_tier)
        quiet = len(C) // BS  # C's full blocks: 40 tokens, 5 blocks, the answer's 7 tokens fill none
        assert counted == {"flood": 5 * value, "quiet": quiet * value}
        assert shares(redis_tier)["flood"][2] == 5  # A's 5 blocks went for B's
        assert_all_free(first)
    finally:
        first.close()
    second = engine_with(tiny_model, tiers)
    try:
        run_as(second, tiny_model, "quiet", C)
        assert second.stats().counters.tier_hits_tokens == (len(C) - 1) // BS * BS
        assert second.stats().tiers[0].hits == (len(C) - 1) // BS
        held = set(chain_hashes(second.config.cache_salt, C, BS))
        assert all(store.client.exists(second.tiers.tiers[0].key(h)) for h in held)
        assert_exact(store, second.tiers.tiers[0])
        assert_all_free(second)
    finally:
        second.close()
