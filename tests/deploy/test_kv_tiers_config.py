"""engine.kv_tiers in the cluster config: each server's tiers, its own disk folder, refused when wrong."""

from pathlib import Path

from deploy.config import parse_config
from engine.config import KvTiersConfig
from tests.support.configs import BASE, error_of

TIERS = {"host_bytes": 1 << 30, "disk_path": "/var/kv", "disk_bytes": 1 << 34}


def test_tiers_are_off_unless_the_config_names_one():
    assert parse_config(BASE, "c.yaml").server_settings("p0", Path("/m")).engine.kv_tiers is None
    empty = parse_config({**BASE, "engine": {"kv_tiers": {"queue_blocks": 8}}}, "c.yaml")
    assert empty.server_settings("p0", Path("/m")).engine.kv_tiers is None


def test_every_server_gets_the_engine_section_s_tiers_in_a_folder_of_its_own():
    cluster = parse_config({**BASE, "engine": {"kv_tiers": TIERS}}, "c.yaml")
    p0 = cluster.server_settings("p0", Path("/m")).engine.kv_tiers
    d0 = cluster.server_settings("d0", Path("/m")).engine.kv_tiers
    assert p0 == KvTiersConfig(host_bytes=1 << 30, disk_path="/var/kv/p0", disk_bytes=1 << 34)
    assert d0 == KvTiersConfig(host_bytes=1 << 30, disk_path="/var/kv/d0", disk_bytes=1 << 34)


def test_an_instance_s_tiers_replace_the_engine_section_s_and_an_empty_one_turns_them_off():
    decode = [{"name": "d0", "port": 9200, "kv_tiers": {"host_bytes": 4096, "queue_blocks": 8}}]
    prefill = [{"name": "p0", "port": 9100, "kv_tiers": {}}]
    cluster = parse_config({**BASE, "engine": {"kv_tiers": TIERS}, "decode": decode, "prefill": prefill}, "c.yaml")
    assert cluster.server_settings("d0", Path("/m")).engine.kv_tiers == KvTiersConfig(host_bytes=4096, queue_blocks=8)
    assert cluster.server_settings("p0", Path("/m")).engine.kv_tiers is None


def test_half_a_disk_tier_or_a_bad_value_is_refused_by_key():
    assert "disk_path and disk_bytes go together" in error_of({**BASE, "engine": {"kv_tiers": {"disk_path": "/k"}}})
    assert "disk_path and disk_bytes go together" in error_of({**BASE, "engine": {"kv_tiers": {"disk_bytes": 9}}})
    assert "'engine.kv_tiers.host_bytes'" in error_of({**BASE, "engine": {"kv_tiers": {"host_bytes": 0}}})
    assert "'engine.kv_tiers.hots_bytes'" in error_of({**BASE, "engine": {"kv_tiers": {"hots_bytes": 1}}})


def test_tiers_on_a_server_split_over_ranks_are_refused_before_it_starts():
    decode = [{"name": "d0", "port": 9200, "tensor_parallel_size": 2}]
    msg = error_of({**BASE, "engine": {"kv_tiers": {"host_bytes": 4096}}, "decode": decode})
    assert "d0: kv_tiers hold one rank's blocks: they need tensor_parallel_size 1" in msg


def test_a_shared_store_s_url_is_a_secret_every_server_gets():
    url = "redis://:hunter2-hunter2@kv.internal:6379/0"
    cluster = parse_config({**BASE, "engine": {"kv_tiers": {"redis_url": url, "redis_timeout_s": 0.05}}}, "c.yaml")
    for name in ("p0", "d0"):
        tiers = cluster.server_settings(name, Path("/m")).engine.kv_tiers
        assert (tiers.redis_url, tiers.redis_timeout_s, tiers.host_bytes) == (url, 0.05, None)
    assert "hunter2" not in repr(cluster.engine)
    assert "'engine.kv_tiers.redis_timeout_s'" in error_of({**BASE, "engine": {"kv_tiers": {"redis_timeout_s": 0}}})


def test_each_tenant_s_share_of_the_shared_store_reaches_every_server_and_needs_the_store():
    tiers = {"redis_url": "redis://kv:6379/0", "redis_max_bytes_per_tenant": 1 << 30}
    router = {"tenants": [{"name": "team-b", "keys": ["kb"]}, {"name": "team-a", "keys": ["ka"]}]}
    cluster = parse_config({**BASE, "engine": {"kv_tiers": tiers}, "router": router}, "c.yaml")
    for name in ("p0", "d0"):
        got = cluster.server_settings(name, Path("/m")).engine.kv_tiers
        assert (got.redis_max_bytes_per_tenant, got.redis_tenants) == (1 << 30, ("default", "team-b", "team-a"))
    plain = {"kv_tiers": {"redis_url": "redis://kv:6379/0"}}
    no_shares = parse_config({**BASE, "engine": plain, "router": router}, "c.yaml")
    assert no_shares.server_settings("p0", Path("/m")).engine.kv_tiers.redis_tenants == ()
    alone = {"redis_max_bytes_per_tenant": 1 << 30}
    beside_host = {"host_bytes": 4096, "redis_max_bytes_per_tenant": 1 << 30}
    for wrong in (alone, beside_host):
        msg = error_of({**BASE, "engine": {"kv_tiers": wrong}})
        assert "redis_max_bytes_per_tenant is a share of the Redis store: set redis_url" in msg
    zero = {**tiers, "redis_max_bytes_per_tenant": 0}
    assert "'engine.kv_tiers.redis_max_bytes_per_tenant'" in error_of({**BASE, "engine": {"kv_tiers": zero}})
