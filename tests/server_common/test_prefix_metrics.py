"""Prefix-cache counters of the engine as a server's /metrics exports them."""

from prometheus_client import generate_latest

from engine import EngineStats
from engine.engine import EngineCounters
from engine.scheduler import SchedulerStats
from server_common.metrics import ServerMetrics


def test_prefix_cache_queries_hits_and_cached_blocks_are_exported():
    counters = EngineCounters()
    counters.add_prefix_lookup(queried=120, hits=96)
    metrics = ServerMetrics(lambda: EngineStats(SchedulerStats(free=10, cached=4, total=16), counters))
    sample = metrics.registry.get_sample_value
    assert sample("pdserve_prefix_cache_queries_tokens_total") == 120
    assert sample("pdserve_prefix_cache_hits_tokens_total") == 96
    assert sample("pdserve_kv_blocks_cached") == 4
    assert sample("pdserve_kv_blocks", {"state": "free"}) == 10
    assert b"pdserve_prefix_cache_hits_tokens_total 96.0" in generate_latest(metrics.registry)


def test_a_later_receiver_s_discards_count_on_from_the_last_one_s():
    """A server switched back to decode (deploy/role_server.py) has a new KV receiver, counting from 0:
    the exported counter carries on from what the earlier one counted, never going back."""
    metrics = ServerMetrics(lambda: EngineStats(SchedulerStats(free=16, cached=0, total=16), EngineCounters()))
    first = {"dropped_unknown": 3, "dropped_expired": 1}
    metrics.watch_transfers(lambda: first)
    sample = metrics.registry.get_sample_value
    assert sample("pdserve_transfers_discarded_total", {"reason": "unknown"}) == 3
    first["dropped_unknown"] = 5
    metrics.watch_transfers(lambda: {"dropped_unknown": 2})
    assert sample("pdserve_transfers_discarded_total", {"reason": "unknown"}) == 7
    assert sample("pdserve_transfers_discarded_total", {"reason": "expired"}) == 1
    assert sample("pdserve_transfers_discarded_total", {"reason": "malformed"}) == 0
