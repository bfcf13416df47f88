"""Fuzzing the router against its own OpenAPI schema (schemathesis): valid and
invalid requests, a bounded number per operation, never get a 5xx, and every
server stays up and holds no KV block afterwards."""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, seed, settings
from schemathesis.checks import not_a_server_error

from tests.guard.conftest import API_KEY

pytestmark = pytest.mark.integration

EXAMPLES = 40  # per operation and generation mode: bounded, the machine is small and shared


@pytest.fixture(scope="module")
def router_schema(guarded):
    schema = schemathesis.openapi.from_url(f"{guarded.router_url}/openapi.json")
    schema.config.generation.update(modes=["positive", "negative"], max_examples=EXAMPLES)
    return schema


@pytest.fixture(scope="module")
def statuses() -> Counter:
    return Counter()


schema = schemathesis.pytest.from_fixture("router_schema")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
@seed(20251129)  # the same examples every run
def test_no_request_the_schema_allows_or_forbids_gets_a_5xx(case, guarded, statuses):
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and zlib.crc32(repr(body).encode()) % 4:
        body["model"] = "tiny"  # most bodies name the served model, so they get past the 404 to the servers
    response = case.call_and_validate(headers={"authorization": f"Bearer {API_KEY}"}, checks=[not_a_server_error],
                                      timeout=30)
    statuses[(case.method, case.path, response.status_code)] += 1


def test_servers_stay_up_and_hold_nothing_after_fuzzing(guarded, statuses):
    print("\nfuzzed (method, path, status): count", dict(sorted(statuses.items())))
    assert not [key for key in statuses if key[2] >= 500]
    assert statuses[("POST", "/v1/chat/completions", 200)] and statuses[("POST", "/v1/completions", 200)]
    health = guarded.http.get(f"{guarded.router_url}/health").json()
    assert health["status"] == "ok" and all(w["healthy"] for w in health["workers"])
    assert guarded.launcher.poll() is None
    guarded.wait_idle(5.0)
