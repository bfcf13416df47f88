"""Fuzzing the router against its own OpenAPI schema (schemathesis): valid and
invalid requests, a bounded number per operation, never get a 5xx, and every
server stays up and holds no KV block afterwards.

Each test fuzzes on its own (no counts shared between tests), so any one of
them passes or fails the same when run alone or in any order."""

from __future__ import annotations

import itertools
import zlib
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.guard.conftest import API_KEY

pytestmark = pytest.mark.integration

EXAMPLES = 40  # per operation and generation mode: bounded, the machine is small and shared
SEED = 20251129  # the same examples every run
GENERATION = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def router_schema(guarded):
    schema = schemathesis.openapi.from_url(f"{guarded.router_url}/openapi.json")
    schema.config.generation.update(modes=["positive", "negative"], max_examples=EXAMPLES)
    return schema


def call(case) -> int:
    """Send ``case`` with the API key; its status (a 5xx fails the test)."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and zlib.crc32(repr(body).encode()) % 4:
        body["model"] = "tiny"  # most bodies name the served model, so they get past the 404 to the servers
    response = case.call_and_validate(headers={"authorization": f"Bearer {API_KEY}"}, checks=[not_a_server_error],
                                      timeout=30)
    return response.status_code


schema = schemathesis.pytest.from_fixture("router_schema")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
@seed(SEED)
def test_no_request_the_schema_allows_or_forbids_gets_a_5xx(case, guarded):
    call(case)


def test_fuzzed_generation_requests_reach_the_model_and_leave_the_servers_up_and_idle(router_schema, guarded):
    statuses: Counter = Counter()
    for path, mode in itertools.product(GENERATION, (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)):

        @given(case=router_schema[path]["POST"].as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @seed(SEED)
        def fuzz(case) -> None:
            statuses[(case.method, case.path, call(case))] += 1

        fuzz()
    print("\nfuzzed (method, path, status): count", dict(sorted(statuses.items())))
    assert not [key for key in statuses if key[2] >= 500]
    assert statuses[("POST", "/v1/chat/completions", 200)] and statuses[("POST", "/v1/completions", 200)]
    health = guarded.http.get(f"{guarded.router_url}/health").json()
    assert health["status"] == "ok" and all(w["healthy"] for w in health["workers"])
    assert guarded.launcher.poll() is None
    guarded.wait_idle(5.0)
