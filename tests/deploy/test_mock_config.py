"""engine.kind and engine.mock_profile in the cluster config: per cluster, per instance, checked together."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.config import ConfigError, parse_config


def cluster(engine: dict | None = None, p0: dict | None = None, d0: dict | None = None) -> dict:
    return {
        "model": "tiny",
        "engine": engine or {},
        "prefill": [{"name": "p0", "port": 9000, **(p0 or {})}],
        "decode": [{"name": "d0", "port": 9010, **(d0 or {})}],
    }


def test_the_kind_and_profile_reach_every_server_s_engine():
    config = parse_config(cluster({"kind": "mock", "mock_profile": "/runs/profile.json"}), "c.yaml")
    engines = [config.server_settings(name, Path("/m")).engine for name in ("p0", "d0")]
    assert [(e.kind, e.mock_profile, e.mode) for e in engines] == [
        ("mock", "/runs/profile.json", "prefill"),
        ("mock", "/runs/profile.json", "decode"),
    ]
    default = parse_config(cluster(), "c.yaml").server_settings("d0", Path("/m")).engine
    assert (default.kind, default.mock_profile) == ("model", None)


def test_an_instance_overrides_the_profile():
    config = parse_config(cluster({"kind": "mock"}, d0={"mock_profile": "/d.json"}), "c.yaml")
    assert [config.server_settings(n, Path("/m")).engine.mock_profile for n in ("p0", "d0")] == [None, "/d.json"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (cluster(p0={"kind": "mock"}), "instances ['p0'] are mock engines and the others are not"),
        (cluster({"kind": "mock"}, d0={"kind": "model"}), "instances ['p0'] are mock engines"),
        (cluster({"mock_profile": "/p.json"}), "mock_profile is set for ['p0', 'd0'], which are not mock engines"),
        (cluster({"kind": "fake"}), "bad value 'fake' for 'engine.kind'"),
    ],
)
def test_mixed_kinds_a_stray_profile_and_an_unknown_kind_are_named(data, message):
    with pytest.raises(ConfigError) as err:
        parse_config(data, "c.yaml")
    assert message in str(err.value) and str(err.value).startswith("c.yaml: ")
