"""Cluster config: strict loading with messages naming file, key and value."""

from pathlib import Path

import pytest

from deploy.config import INSTANCE_ENGINE_KEYS, ConfigError, EngineDefaults, Instance, load_config, parse_config
from engine.config import EngineConfig
from tests.support.configs import BASE, error_of

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["1p1d", "2p1d", "1p2d", "colocated", "tiny-1p1d"])
def test_shipped_configs_load(name):
    cluster = load_config(CONFIGS / f"{name}.yaml")
    assert cluster.router.port == 8000
    assert cluster.instances()


def test_default_config_is_smollm2_with_different_block_sizes():
    cluster = load_config(CONFIGS / "1p1d.yaml")
    assert cluster.model == "smollm2" and cluster.device == "cpu"
    assert cluster.prefill[0].block_size != cluster.decode[0].block_size


def test_unknown_key_names_file_key_and_value():
    assert (
        error_of({**BASE, "decode": [{"name": "d0", "port": 9200, "block_sise": 32}]})
        == "c.yaml: unknown key 'decode[0].block_sise' (value 32)"
    )


def test_bad_value_names_file_key_and_value():
    msg = error_of({**BASE, "router": {"policy": "random"}})
    assert msg.startswith("c.yaml: bad value 'random' for 'router.policy'")
    assert "round_robin" in msg


def test_mistyped_port_and_missing_model_are_reported():
    assert "bad value 'abc' for 'prefill[0].port'" in error_of({**BASE, "prefill": [{"name": "p0", "port": "abc"}]})
    assert error_of({"prefill": BASE["prefill"], "decode": BASE["decode"]}) == "c.yaml: missing key 'model'"


def test_ports_must_be_unique_including_the_default_kv_port():
    msg = error_of({**BASE, "decode": [{"name": "d0", "port": 9101}]})
    assert "[9101]" in msg


def test_a_cluster_is_either_colocated_or_prefill_plus_decode():
    assert "not both" in error_of({**BASE, "colocated": [{"name": "c0", "port": 9300}]})
    assert "at least one prefill" in error_of({"model": "tiny", "decode": BASE["decode"]})


def test_unreadable_and_invalid_yaml_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: cannot read"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)


def test_instance_overrides_win_over_engine_defaults(tmp_path):
    cluster = parse_config(
        {
            **BASE,
            "engine": {"num_threads": 3, "block_size": 8},
            "prefill": [{"name": "p0", "port": 9100, "num_threads": 1, "device": "cpu"}],
        },
        "c.yaml",
    )
    p = cluster.server_settings("p0", tmp_path)
    d = cluster.server_settings("d0", tmp_path)
    assert (p.engine.num_threads, p.engine.block_size, p.engine.mode) == (1, 8, "prefill")
    assert (d.engine.num_threads, d.engine.block_size, d.engine.mode) == (3, 32, "decode")
    assert (p.port, p.kv_port, d.kv_port) == (9100, 9101, 9201)


def test_router_settings_list_every_worker_with_its_role(tmp_path):
    cluster = parse_config(
        {**BASE, "router": {"port": 9000, "policy": "least_loaded", "local_prefill_threshold": 32}}, "c.yaml"
    )
    r = cluster.router_settings(tmp_path)
    assert [(w.name, w.role, w.url) for w in r.workers] == [
        ("p0", "prefill", "http://127.0.0.1:9100"),
        ("d0", "decode", "http://127.0.0.1:9200"),
    ]
    assert (r.port, r.policy, r.local_prefill_threshold, r.served_model_name) == (9000, "least_loaded", 32, "tiny")


def test_colocated_instances_are_decode_workers_for_the_router(tmp_path):
    cluster = parse_config({"model": "/models/m", "colocated": [{"name": "c0", "port": 9300}]}, "c.yaml")
    assert cluster.mode == "colocated" and cluster.model_name == "m"
    assert [w.role for w in cluster.router_settings(tmp_path).workers] == ["decode"]
    assert cluster.server_settings("c0", tmp_path).engine.mode == "colocated"


def test_unknown_instance_name_is_an_error():
    with pytest.raises(ConfigError, match="no instance named 'x'"):
        parse_config(BASE, "c.yaml").role_of("x")


def test_prefix_caching_is_on_by_default_and_the_engine_section_turns_it_off(tmp_path):
    on = parse_config(BASE, "c.yaml").server_settings("d0", tmp_path)
    off = parse_config({**BASE, "engine": {"prefix_caching": False}}, "c.yaml").server_settings("p0", tmp_path)
    assert (on.engine.prefix_caching, off.engine.prefix_caching) == (True, False)
    assert "prefix_caching" in error_of({**BASE, "engine": {"prefix_caching": "sometimes"}})


def test_every_engine_key_of_the_file_is_an_engine_setting_and_instances_override_theirs():
    # The engine: section and an instance's overrides carry EngineConfig's own names and bounds, so
    # a key added to one without the others, or spelt differently, fails here.
    engine_fields = set(EngineConfig.__dataclass_fields__)
    # the one key that exists only in the file: what `kv_cache_bytes: auto` shares out (deploy/kv_memory.py)
    assert set(EngineDefaults.model_fields) - engine_fields == {"kv_cache_memory_fraction"}
    # an instance's own keys (not the engine's): anything else it carries overrides the engine: section
    own = {"name", "port", "kv_port", "host", "bind_host", "max_inflight"}
    assert set(INSTANCE_ENGINE_KEYS) == set(Instance.model_fields) - own
    assert error_of({**BASE, "engine": {"block_size": 0}}).endswith("Input should be greater than or equal to 1")
    assert "'prefill[0].block_size'" in error_of({**BASE, "prefill": [{"name": "p0", "port": 9100, "block_size": 257}]})


def test_stored_responses_go_where_the_config_says_else_where_the_launcher_says_else_memory(tmp_path):
    alone = parse_config(BASE, "c.yaml")
    assert alone.router_settings(tmp_path).response_store.path == ":memory:"
    assert alone.router_settings(tmp_path, "/run/x/responses.sqlite").response_store.path == "/run/x/responses.sqlite"
    named = parse_config({**BASE, "router": {"response_store": {"path": "/data/r.sqlite", "max_rows": 5}}}, "c.yaml")
    store = named.router_settings(tmp_path, "/run/x/responses.sqlite").response_store
    assert (store.path, store.max_rows) == ("/data/r.sqlite", 5)


def test_a_postgres_url_is_a_secret_instead_of_the_sqlite_path(tmp_path):
    url = "postgresql://pdserve:hunter2-hunter2@db.internal:5432/pdserve"
    shared = parse_config({**BASE, "router": {"response_store": {"url": url, "ttl_s": 60}}}, "c.yaml")
    store = shared.router_settings(tmp_path, "/run/x/responses.sqlite").response_store  # the launcher's file unused
    assert (store.url, store.path, store.ttl_s) == (url, ":memory:", 60)
    assert "hunter2" not in repr(shared) + repr(shared.router_settings(tmp_path))
    both = error_of({**BASE, "router": {"response_store": {"url": url, "path": "/data/r.sqlite"}}})
    assert "router.response_store.path or router.response_store.url, not both" in both and "hunter2" not in both
    mysql = error_of({**BASE, "router": {"response_store": {"url": "mysql://u:hunter2-hunter2@h/db"}}})
    assert "must be a postgresql:// URL" in mysql and "hunter2" not in mysql
    assert "hunter2" not in error_of({**BASE, "router": {"response_store": {"urll": url}}})
    # A section's own check never echoes the section, which may hold other secrets too.
    keys = error_of({**BASE, "router": {"api_keys": ["hunter2-hunter2"], "api_keys_file": "/k"}})
    assert "router.api_keys or router.api_keys_file, not both" in keys and "hunter2" not in keys


def test_tensor_parallel_size_flows_to_every_role_per_instance():
    colocated = parse_config(
        {"model": "tiny", "engine": {"tensor_parallel_size": 2}, "colocated": [{"name": "c0", "port": 9300}]}, "c.yaml"
    )
    assert colocated.server_settings("c0", Path("/m")).engine.tensor_parallel_size == 2
    split = parse_config({**BASE, "decode": [{"name": "d0", "port": 9200, "tensor_parallel_size": 4}]}, "c.yaml")
    assert split.server_settings("d0", Path("/m")).engine.tensor_parallel_size == 4
    assert split.server_settings("p0", Path("/m")).engine.tensor_parallel_size == 1


def test_a_tensor_parallel_size_the_model_does_not_divide_is_named_before_any_server_starts(tiny_model):
    cluster = parse_config(
        {
            "model": "tiny",
            "engine": {"tensor_parallel_size": 2},
            "colocated": [{"name": "c0", "port": 9300}, {"name": "c1", "port": 9400, "tensor_parallel_size": 3}],
        },
        "c.yaml",
    )
    assert cluster.tensor_parallel_problems(Path(tiny_model)) == [
        f"c1: 4 attention heads cannot be split evenly over tensor_parallel_size=3 ({tiny_model})"
    ]


def test_tenants_bring_their_keys_classes_and_limits_to_the_router(tmp_path):
    keys = tmp_path / "batch-keys"
    keys.write_text("sk-batch-1\n\nsk-batch-2\n")
    router = {
        "api_keys": ["sk-plain-key-1"],
        "priority_classes": ["gold", "silver", "bronze"],
        "tenants": [
            {"name": "team-a", "keys": ["sk-team-a-1"], "weight": 3, "priority": "gold", "requests_per_minute": 60},
            {"name": "batch", "keys_file": str(keys), "priority": "bronze", "tokens_per_minute": 100000},
            {"name": "default", "requests_per_minute": 600},
        ],
        "tenant_share_window_s": 4.5,
    }
    settings = parse_config({**BASE, "router": router}, "c.yaml").router_settings(tmp_path)
    assert settings.api_keys == ("sk-plain-key-1", "sk-team-a-1", "sk-batch-1", "sk-batch-2")
    assert settings.priority_classes == ("gold", "silver", "bronze")
    assert settings.tenant_share_window_s == 4.5
    a, batch, default = settings.tenants
    assert (a.name, a.keys, a.weight, a.priority, a.requests_per_minute) == ("team-a", ("sk-team-a-1",), 3, "gold", 60)
    assert (batch.keys, batch.tokens_per_minute, default.keys) == (("sk-batch-1", "sk-batch-2"), 100000, ())
    assert "sk-team-a-1" not in repr(settings)


@pytest.mark.parametrize(
    "router, message",
    [
        ({"tenants": [{"name": "a", "priority": "vip"}]}, "priority 'vip' is not one of router.priority_classes"),
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "a name is used twice: ['a']"),
        ({"tenants": [{"name": "Team A"}]}, "'router.tenants[0].name'"),
        ({"tenants": [{"name": "a", "weight": 0}]}, "'router.tenants[0].weight'"),
        ({"tenants": [{"name": "default", "keys": ["sk-secret-123"]}]}, "its keys are those listed only under"),
        ({"priority_classes": ["a", "a"]}, "a class is listed twice"),
        ({"tenant_share_window_s": -1}, "'router.tenant_share_window_s'"),
        ({"tenants": [{"name": "a", "keys": ["sk-secret-123"], "keys_file": "/k"}]}, "set keys or keys_file"),
    ],
)
def test_bad_tenants_are_refused_naming_what_is_wrong(router, message):
    error = error_of({**BASE, "router": router})
    assert message in error and "sk-secret-123" not in error


def test_one_key_for_two_tenants_is_refused(tmp_path):
    router = {"tenants": [{"name": "a", "keys": ["sk-shared-1"]}, {"name": "b", "keys": ["sk-shared-1"]}]}
    with pytest.raises(ConfigError, match="one key is listed for 'a' and for 'b'"):
        parse_config({**BASE, "router": router}, "c.yaml").router_settings(tmp_path)


def test_window_kv_blocks_reach_a_colocated_server_and_nothing_else(tmp_path):
    colocated = {"model": "/models/m", "colocated": [{"name": "c0", "port": 9300}]}
    pooled = {**colocated, "engine": {"window_kv_blocks": 64}}
    assert parse_config(pooled, "c.yaml").server_settings("c0", tmp_path).engine.window_kv_blocks == 64
    assert parse_config(colocated, "c.yaml").server_settings("c0", tmp_path).engine.window_kv_blocks is None
    refused = "engine.window_kv_blocks needs a colocated cluster, tensor_parallel_size 1, no kv_tiers"
    assert f"p0: {refused}" in error_of({**BASE, "engine": {"window_kv_blocks": 64}})
    split = {**colocated, "engine": {"window_kv_blocks": 64, "tensor_parallel_size": 2}}
    assert f"c0: {refused}" in error_of(split)
