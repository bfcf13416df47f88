"""Clusters for the guard tests: real processes on 127.0.0.1 started with
`pdserve launch` (tests.support.cluster), one torch thread each, stopped by pid.

``guarded`` has API keys, an internal secret and request limits; the overload
and drain modules start their own, with tight in-flight limits or two decode
servers."""

from __future__ import annotations

import pytest

from tests.support.cluster import Cluster, make_config

API_KEY = "sk-guard-test-key-not-secret-elsewhere"
SECRET = "guard-internal-secret-0123456789abcdef"
MAX_BODY = 64 * 1024
MAX_PROMPT = 256
MAX_TOKENS = 16


def start(tmp_path_factory, template: str, model: str, changes: dict) -> Cluster:
    folder = tmp_path_factory.mktemp(template)
    return Cluster(make_config(folder, template, model, {"drain_timeout_s": 10, **changes}), folder)


@pytest.fixture(scope="package")
def guarded(tmp_path_factory, tiny_model):
    """1P1D with API keys, an internal secret and limits on body, prompt and max_tokens."""
    c = start(
        tmp_path_factory,
        "tiny-1p1d",
        tiny_model,
        {
            "max_model_len": 512,
            "security": {"internal_secret": SECRET},
            "router": {
                "api_keys": [API_KEY],
                "max_body_bytes": MAX_BODY,
                "max_prompt_tokens": MAX_PROMPT,
                "max_tokens": MAX_TOKENS,
            },
        },
    )
    yield c
    c.stop()


@pytest.fixture
def idle_after(cluster: Cluster):
    """The module's cluster; afterwards every server is back to zero reserved and running blocks."""
    yield cluster
    cluster.wait_idle(5.0)
