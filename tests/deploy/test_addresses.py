"""The address model of a cluster config: an instance's ``host`` is both where it
binds and where the router and its peers reach it (HTTP and KV ports)."""

from __future__ import annotations

from pathlib import Path

from deploy.config import parse_config

MODEL = Path("/models/tiny")
SECRET = {"internal_secret": "a-secret-of-at-least-16-chars"}


def _cluster(decode_host: str) -> dict:
    return {
        "model": "tiny",
        "security": SECRET,
        "prefill": [{"name": "p0", "host": "10.213.0.12", "port": 8100}],
        "decode": [{"name": "d0", "host": decode_host, "port": 8200}],
    }


def test_each_instance_binds_and_is_reached_at_its_own_host():
    cluster = parse_config(_cluster("d0.example.test"), "c.yaml")
    decode = cluster.server_settings("d0", MODEL)
    assert (decode.host, decode.port, decode.kv_port) == ("d0.example.test", 8200, 8201)
    assert dict(cluster.server_settings("p0", MODEL).decode_peers) == {"d0": "http://d0.example.test:8200"}
    assert {w.name: w.url for w in cluster.router_settings(MODEL).workers} == {
        "p0": "http://10.213.0.12:8100",
        "d0": "http://d0.example.test:8200",
    }
