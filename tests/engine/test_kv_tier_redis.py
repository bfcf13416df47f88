"""The shared KV tier on a real Redis server (engine/tiers/redis_store.py, tests/redis_server.py): one engine's
evicted blocks serve another engine started later (a restarted or second server), a changed value is counted
and recomputed, a store killed mid-run costs no request, and the server's byte limit holds. Tokens equal
transformers' (float32) each time, and every block is free after every scenario."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.config import KvTiersConfig
from engine.prefix_cache import chain_hashes
from engine.tiers.redis_store import RedisTier
from tests.engine.oracle import hf_greedy
from tests.engine.test_kv_tiers import (
    A_LOADED,
    BS,
    A,
    B,
    C,
    assert_all_free,
    engine_with,
    evict_a,
    remote_prompt,
    run,
)
from tests.redis_server import RedisServer, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")


@pytest.fixture
def store():
    server = RedisServer()
    yield server
    server.stop()


def shared(store: RedisServer) -> KvTiersConfig:
    return KvTiersConfig(redis_url=store.url)


def test_blocks_one_engine_evicted_serve_another_engine_started_later(tiny_model, store):
    first = engine_with(tiny_model, shared(store))
    try:
        evict_a(first, tiny_model)
        assert first.stats().tiers[0].bytes_written > 0
    finally:
        first.close()
    second = engine_with(tiny_model, shared(store))
    try:
        run(second, tiny_model, A)
        (redis_stats,) = second.stats().tiers
        assert (redis_stats.name, redis_stats.hits, redis_stats.errors) == ("redis", A_LOADED // BS, 0)
        assert second.stats().counters.tier_hits_tokens == A_LOADED
        assert_all_free(second)
    finally:
        second.close()


def test_a_changed_value_is_corrupt_deleted_and_recomputed(tiny_model, store):
    engine = engine_with(tiny_model, shared(store))
    try:
        evict_a(engine, tiny_model)
        tier = engine.tiers.tiers[0]
        key = tier.key(chain_hashes(engine.config.cache_salt, A, BS)[1])
        value = bytearray(store.client.get(key))
        value[-1] ^= 1
        store.client.set(key, bytes(value))
        run(engine, tiny_model, A)
        stats = engine.stats().tiers[0]
        assert (stats.hits, stats.corrupt) == (1, 1)
        assert engine.stats().counters.tier_hits_tokens == BS
        assert store.client.exists(key) == 0
        assert_all_free(engine)
    finally:
        engine.close()


def test_a_store_killed_mid_run_costs_no_request(tiny_model, store):
    engine = engine_with(tiny_model, shared(store))
    try:
        evict_a(engine, tiny_model)
        store.stop()
        for tokens in (A, B, C, A):  # every lookup and write now fails: all computed, all exact
            run(engine, tiny_model, tokens)
        assert engine.tiers.drain()
        stats = engine.stats().tiers[0]
        assert stats.errors >= 1 and stats.hits == 0
        assert engine.stats().counters.tier_hits_tokens == 0
        assert_all_free(engine)
    finally:
        engine.close()


def test_the_store_keeps_within_the_redis_server_s_byte_limit():
    server = RedisServer(max_bytes=4 << 20)
    tier = RedisTier(server.url, "limit-test", queue_blocks=1024)
    try:
        for h in range(600):  # 600 blocks of 16 KiB: more than twice the limit
            assert tier.put(h, torch.full((16 << 10,), h % 251, dtype=torch.uint8))
        assert tier.drain(60)
        info = server.client.info("memory")
        assert info["used_memory"] <= info["maxmemory"] == 4 << 20
        assert 0 < server.client.dbsize() < 600
        newest = tier.get(599)
        assert newest is not None and torch.equal(newest, torch.full((16 << 10,), 599 % 251, dtype=torch.uint8))
    finally:
        tier.close()
        server.stop()


def test_the_next_turn_s_prefill_loads_the_blocks_the_decode_server_generated_from_the_store(tiny_model, store):
    """Decode-to-prefill reuse through the shared store: D publishes a finished turn's blocks (its answer's
    included) when it frees them; P, whose blocks match D's, prefills the next turn loading the answer's
    blocks from the store and computing only the new tokens; D's tokens equal transformers'."""
    answer_sampling = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prefill = engine_with(tiny_model, shared(store), mode="prefill", num_blocks=32)
    decode = engine_with(tiny_model, shared(store), mode="decode", num_blocks=32)
    try:
        answer = remote_prompt(prefill, decode, "turn1", A, answer_sampling)
        assert answer == hf_greedy(tiny_model, A, 20, ignore_eos=True)
        assert decode.tiers.drain() and prefill.tiers.drain()
        turn2 = A + answer + [(11 * i) % 300 + 21 for i in range(10)]  # 70 tokens
        # P holds A's 5 blocks itself; D computed the answer's K/V up to token 58: blocks 5 and 6 are full
        before = prefill.stats().counters
        assert remote_prompt(prefill, decode, "turn2", turn2) == hf_greedy(tiny_model, turn2, 8, ignore_eos=True)
        after = prefill.stats().counters
        assert (after.prefix_hits_tokens - before.prefix_hits_tokens, after.tier_hits_tokens) == (56, 16)
        assert after.prompt_tokens - before.prompt_tokens == len(turn2) - 56
        assert prefill.stats().tiers[0].hits == 2
        for engine in (prefill, decode):
            engine.check_integrity()
            assert engine.block_counts() == {"free": 32, "reserved": 0, "running": 0}
    finally:
        prefill.close()
        decode.close()
