"""Config for overload, limits and security: secrets never echoed, exposed
internal servers need a secret, per-worker limits default sensibly."""

from __future__ import annotations

import pytest

from deploy.config import ROUTER_KEYS_AS_IS, ConfigError, RouterConfig, parse_config

SECRET = "a-secret-of-at-least-16-chars"
BASE = {
    "model": "tiny",
    "prefill": [{"name": "p0", "port": 9100}],
    "decode": [{"name": "d0", "port": 9200, "max_num_seqs": 8}],
}


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "c.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    "data",
    [
        {**BASE, "security": {"internal_secrt": SECRET}},
        {**BASE, "security": {"internal_secret": SECRET, "internal_secret_file": "/x"}},
        {**BASE, "security": {"internal_secret": SECRET[:10]}},
        {**BASE, "router": {"api_keys": [SECRET], "api_keyz": [SECRET]}},
        {**BASE, "router": {"api_keys": SECRET}},
        {**BASE, "internal_secret": SECRET},
        {**BASE, "router": {"api_key": SECRET}},
    ],
    ids=["unknown-key", "both", "too-short", "typo-next-to-keys", "keys-not-a-list", "misplaced", "singular"],
)
def test_config_errors_never_show_a_secret(data):
    message = error_of(data)
    assert message.startswith("c.yaml: ")
    assert SECRET not in message and SECRET[:10] not in message


def test_secrets_are_not_in_any_repr(tmp_path):
    cluster = parse_config(
        {**BASE, "security": {"internal_secret": SECRET}, "router": {"api_keys": [SECRET + "k"]}}, "c.yaml"
    )
    router = cluster.router_settings(tmp_path)
    server = cluster.server_settings("d0", tmp_path)
    assert router.internal_secret == SECRET and router.api_keys == (SECRET + "k",)
    assert server.internal_secret == SECRET
    for obj in (cluster, router, server):
        assert SECRET not in repr(obj) and SECRET not in str(obj)
    assert SECRET not in cluster.model_dump_json()


def test_internal_servers_on_other_interfaces_need_a_secret(tmp_path):
    exposed = {**BASE, "decode": [{"name": "d0", "port": 9200, "host": "0.0.0.0"}]}
    assert "d0 (0.0.0.0)" in error_of(exposed) and "security.internal_secret" in error_of(exposed)
    assert "p0 (10.0.0.5)" in error_of({**BASE, "host": "10.0.0.5"})
    cluster = parse_config({**exposed, "security": {"internal_secret": SECRET}}, "c.yaml")
    assert cluster.server_settings("d0", tmp_path).host == "0.0.0.0"
    assert cluster.server_settings("p0", tmp_path).host == "127.0.0.1"
    public_router = parse_config({**BASE, "router": {"host": "0.0.0.0"}}, "c.yaml")  # only the router is exposed
    assert public_router.router_settings(tmp_path).host == "0.0.0.0"


def test_the_secret_can_come_from_a_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    cluster = parse_config({**BASE, "security": {"internal_secret_file": str(path)}}, "c.yaml")
    assert cluster.router_settings(tmp_path).internal_secret == SECRET
    missing = parse_config({**BASE, "security": {"internal_secret_file": str(tmp_path / "nope")}}, "c.yaml")
    with pytest.raises(ConfigError, match="cannot read it"):
        missing.router_settings(tmp_path)


def test_in_flight_limits_default_to_each_engines_max_num_seqs(tmp_path):
    def limits(data) -> dict:
        return {w.name: w.max_inflight for w in parse_config(data, "c.yaml").router_settings(tmp_path).workers}

    assert limits(BASE) == {"p0": 64, "d0": 8}
    assert limits({**BASE, "router": {"max_inflight_per_worker": 3}}) == {"p0": 3, "d0": 3}
    assert limits(
        {**BASE, "router": {"max_inflight_per_worker": 3}, "prefill": [{"name": "p0", "port": 9100, "max_inflight": 5}]}
    ) == {"p0": 5, "d0": 3}


def test_overload_and_limit_keys_reach_the_router(tmp_path):
    router = parse_config(
        {
            **BASE,
            "drain_timeout_s": 7,
            "router": {
                "max_queued_requests": 9,
                "queue_timeout_s": 2,
                "retry_after_s": 4,
                "max_body_bytes": 2048,
                "max_prompt_tokens": 100,
                "max_tokens": 50,
            },
        },
        "c.yaml",
    ).router_settings(tmp_path)
    assert (
        router.max_queued_requests,
        router.queue_timeout_s,
        router.retry_after_s,
        router.max_body_bytes,
        router.max_prompt_tokens,
        router.max_tokens,
        router.drain_timeout_s,
    ) == (9, 2, 4, 2048, 100, 50, 7)


def test_every_router_key_reaches_the_router_under_its_own_name():
    # A key the router: section gains is either a RouterSettings field of the same name (passed as is)
    # or one of these, which the config turns into something else; none is dropped on the way.
    derived = {"host", "api_keys", "api_keys_file", "grammar_limits", "max_inflight_per_worker", "response_store"}
    derived |= {"tenants", "priority_classes"}
    derived |= {"port", "replicas", "replica_ports"}  # a replica's port, its limit_share and its worker shares
    assert set(RouterConfig.model_fields) == set(ROUTER_KEYS_AS_IS) | derived
    assert not set(ROUTER_KEYS_AS_IS) & derived
