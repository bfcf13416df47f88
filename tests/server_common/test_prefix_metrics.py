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
