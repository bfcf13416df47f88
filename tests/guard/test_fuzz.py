"""Fuzzing the router against its own OpenAPI document (schemathesis), on a real cluster: valid
and invalid requests, a bounded number per operation and generation mode, each held to every
check schemathesis has (tests/support/openapi_checks.py: status codes, content types, response
schemas and headers, negative data rejected, positive data accepted, never a 5xx, 405 with Allow,
auth not ignored, ...), with the request's ``model`` pinned to the served model so that valid
requests reach generation; afterwards every server is up and holds no KV block.

The same examples every run (a fixed seed); bounded: ``router.max_tokens`` (16, which the
document states as ``max_tokens``' maximum), ``EXAMPLES`` per operation and mode, and a
deadline per example."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, seed, settings
from schemathesis import GenerationMode

from tests.guard.conftest import API_KEY
from tests.support.openapi_checks import all_checks, load

pytestmark = pytest.mark.integration

EXAMPLES = 30  # per operation and generation mode: bounded, the machine is small and shared
SEED = 20251129  # the same examples every run
DEADLINE = timedelta(seconds=20)  # one example: a request of at most 16 tokens on the tiny model takes far less
REQUEST_TIMEOUT_S = 30
NOTHING_TO_NEGATE = ("/health", "/metrics")  # no parameter, body or auth to make invalid


def test_the_router_answers_as_its_openapi_document_says_under_every_schemathesis_check(guarded):
    schema = load(guarded.http.get(f"{guarded.router_url}/openapi.json").json(), "tiny")
    checks = all_checks()
    statuses: Counter = Counter()
    for operation in schema.get_all_operations():
        operation = operation.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and operation.path in NOTHING_TO_NEGATE:
                continue

            @given(case=operation.as_strategy(mode))
            @settings(max_examples=EXAMPLES, deadline=DEADLINE, suppress_health_check=list(HealthCheck), database=None)
            @seed(SEED)
            def fuzz(case, mode) -> None:
                response = case.call_and_validate(
                    base_url=guarded.router_url,
                    checks=checks,
                    headers={"Authorization": f"Bearer {API_KEY}"},
                    timeout=REQUEST_TIMEOUT_S,
                )
                statuses[(case.method, case.path, mode.value, response.status_code)] += 1

            fuzz(mode=mode)
    print("\nfuzzed (method, path, mode, status): count", dict(sorted(statuses.items())))
    assert statuses[("POST", "/v1/chat/completions", "positive", 200)]
    assert statuses[("POST", "/v1/completions", "positive", 200)]
    health = guarded.http.get(f"{guarded.router_url}/health").json()
    assert health["status"] == "ok" and all(w["healthy"] for w in health["workers"])
    assert guarded.launcher.poll() is None
    guarded.wait_idle(5.0)
