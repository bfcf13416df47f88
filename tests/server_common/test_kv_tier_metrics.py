"""KV tier counters of a real engine as a server's /metrics exports them (server_common/metrics.py)."""

from __future__ import annotations

from prometheus_client import generate_latest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import KvTiersConfig
from server_common.metrics import ServerMetrics

SAMPLING = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def prompt(k: int) -> list[int]:
    return [(13 * i + 97 * k) % 450 + 7 for i in range(40)]


def test_tier_hits_bytes_and_limits_are_exported_per_tier(tiny_model, tmp_path):
    tiers = KvTiersConfig(host_bytes=1 << 24, disk_path=str(tmp_path / "kv"), disk_bytes=1 << 24)
    engine = LLMEngine(
        EngineConfig(model=tiny_model, block_size=8, num_blocks=12, max_num_seqs=1, num_threads=1, kv_tiers=tiers)
    )
    try:
        metrics = ServerMetrics(engine.stats)
        for k in (0, 1, 2, 3):
            engine.generate([prompt(k)], SAMPLING)
        assert engine.tiers is not None and engine.tiers.drain()
        engine.generate([prompt(0)], SAMPLING)
        host, disk = engine.stats().tiers
        sample = metrics.registry.get_sample_value
        assert sample("pdserve_kv_tier_hits_total", {"tier": "host"}) == host.hits == 4
        assert sample("pdserve_kv_tier_hits_total", {"tier": "disk"}) == 0
        assert sample("pdserve_kv_tier_read_bytes_total", {"tier": "host"}) == 4 * engine.tiers.block_nbytes
        assert sample("pdserve_kv_tier_written_bytes_total", {"tier": "disk"}) == disk.bytes_written > 0
        assert sample("pdserve_kv_tier_held_bytes", {"tier": "disk"}) == disk.bytes_held
        assert sample("pdserve_kv_tier_limit_bytes", {"tier": "host"}) == 1 << 24
        assert sample("pdserve_kv_tier_corrupt_entries_total", {"tier": "disk"}) == 0
        assert sample("pdserve_kv_tier_dropped_writes_total", {"tier": "host"}) == 0
        assert sample("pdserve_prefix_cache_tier_hits_tokens_total") == 32
        assert b'pdserve_kv_tier_hits_total{tier="host"} 4.0' in generate_latest(metrics.registry)
    finally:
        engine.close()


def test_a_server_without_tiers_exports_no_tier_series(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, block_size=8, num_blocks=12, num_threads=1))
    metrics = ServerMetrics(engine.stats)
    assert metrics.registry.get_sample_value("pdserve_kv_tier_hits_total", {"tier": "host"}) is None
    assert metrics.registry.get_sample_value("pdserve_prefix_cache_tier_hits_tokens_total") == 0
