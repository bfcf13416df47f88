"""The router's published OpenAPI document is true: its statuses, bodies, headers and bounds,
checked by reading it and by every schemathesis check against the router with scripted workers
(no servers; tests/guard/test_fuzz.py runs the same checks against a real cluster)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, seed, settings
from schemathesis import GenerationMode

from router.api.model import ServedModel
from router.api.openapi import decimal_below
from router.app import create_app
from router.settings import RouterSettings, WorkerSpec
from tests.support.fakes import FakeWorkerClient, in_rotation, make_byte_tokenizer
from tests.support.openapi_checks import all_checks, load

WORKERS = (WorkerSpec("p0", "prefill", "http://p0"), WorkerSpec("d0", "decode", "http://d0"))
KEY = "sk-openapi-test"
VOCAB = 257  # the byte tokenizer's
CONTEXT = 512
MAX_TOKENS = 16
EXAMPLES = 25  # per operation and generation mode
SEED = 20261201
OPENAI_ROUTES = {
    ("post", "/v1/chat/completions"),
    ("post", "/v1/completions"),
    ("get", "/v1/models"),
    ("get", "/v1/models/{model}"),
    ("post", "/v1/responses"),
    ("get", "/v1/responses/{response_id}"),
    ("post", "/v1/responses/{response_id}/cancel"),
    ("delete", "/v1/responses/{response_id}"),
    ("get", "/v1/responses/{response_id}/input_items"),
    ("post", "/tokenize"),
    ("post", "/detokenize"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return ServedModel.load("tiny", str(make_byte_tokenizer(tmp_path_factory.mktemp("bytetok"), CONTEXT)))


def make_app(model, **overrides):
    settings = RouterSettings(
        model_path=model.root, served_model_name="tiny", workers=WORKERS, queue_timeout_s=0.1, **overrides
    )
    return in_rotation(
        create_app(settings, model=model, client=FakeWorkerClient(reply=model.tokenizer("hello")["input_ids"]))
    )


@pytest.fixture(scope="module")
def guarded_doc(model):
    return make_app(model, api_keys=(KEY,), max_tokens=MAX_TOKENS, max_prompt_tokens=256).openapi()


def operations(doc):
    return [(method, path, op) for path, ops in doc["paths"].items() for method, op in ops.items()]


def test_every_route_documents_its_real_statuses_each_error_in_openai_shape_and_never_422(guarded_doc):
    statuses = {(m, p): sorted(op["responses"]) for m, p, op in operations(guarded_doc)}
    generation = ["200", "400", "401", "404", "413", "429", "500", "503"]
    assert statuses == {
        ("post", "/v1/chat/completions"): generation,
        ("post", "/v1/completions"): generation,
        ("get", "/v1/models"): ["200", "401", "500"],
        ("get", "/v1/models/{model}"): ["200", "401", "404", "500"],
        ("post", "/v1/responses"): generation,
        ("get", "/v1/responses/{response_id}"): ["200", "400", "401", "404", "500"],
        ("post", "/v1/responses/{response_id}/cancel"): ["200", "400", "401", "404", "500"],
        ("delete", "/v1/responses/{response_id}"): ["200", "401", "404", "500"],
        ("get", "/v1/responses/{response_id}/input_items"): ["200", "400", "401", "404", "500"],
        ("post", "/tokenize"): ["200", "400", "401", "404", "413", "500"],
        ("post", "/detokenize"): ["200", "400", "401", "404", "413", "500"],
        ("get", "/health"): ["200", "500", "503"],
        ("get", "/metrics"): ["200"],
    }
    for method, path, op in operations(guarded_doc):
        for status, answer in op["responses"].items():
            assert answer["headers"]["X-Request-Id"]["required"]
            if status.startswith(("4", "5")) and path != "/health":
                assert answer["content"] == {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                }, (method, path, status)
    schemas = guarded_doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]


def test_success_bodies_are_documented_as_the_router_sends_them(guarded_doc):
    paths = guarded_doc["paths"]
    for path, body in (("/v1/chat/completions", "ChatCompletion"), ("/v1/completions", "Completion")):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body}"}
        assert content["text/event-stream"]["schema"]["required"] == ["data"]
    assert paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelList"
    }
    assert paths["/v1/models/{model}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelCard"
    }
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for status in ("200", "503"):
        assert paths["/health"]["get"]["responses"][status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Health"
        }


def test_usage_always_has_prompt_tokens_details_with_cached_tokens(guarded_doc):
    schemas = guarded_doc["components"]["schemas"]
    assert "prompt_tokens_details" in schemas["Usage"]["required"]
    assert schemas["PromptTokensDetails"]["required"] == ["cached_tokens"]
    assert "usage" in schemas["ChatCompletion"]["required"] and "usage" in schemas["Completion"]["required"]


def test_admin_and_debug_routes_are_left_out_of_the_document(guarded_doc):
    assert not [p for p in guarded_doc["paths"] if p.startswith(("/admin", "/debug"))]


def test_the_document_has_the_deployments_bounds_and_security(model, guarded_doc):
    request = guarded_doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["max_tokens"]["anyOf"][0]["maximum"] == MAX_TOKENS
    assert request["min_tokens"]["anyOf"][0]["maximum"] == MAX_TOKENS
    assert request["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == VOCAB - 1
    assert request["prompt"]["anyOf"][1]["items"]["maximum"] == VOCAB - 1
    assert request["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"] == decimal_below(VOCAB)
    secured = {(m, p) for m, p, op in operations(guarded_doc) if op.get("security") == [{"apiKey": []}]}
    assert secured == OPENAI_ROUTES
    open_doc = make_app(model).openapi()  # no API keys, no router.max_tokens
    assert "securitySchemes" not in open_doc["components"]
    assert not [op for _, _, op in operations(open_doc) if "401" in op["responses"] or "security" in op]
    request = open_doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert request["max_completion_tokens"]["anyOf"][0]["maximum"] == CONTEXT - 1
    assert not re.search(r"x-pdserve", repr(open_doc))


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 100, 257, 1000, 32000, 151936])
def test_decimal_below_matches_exactly_the_numbers_below_n(n):
    pattern = re.compile(decimal_below(n))
    assert [i for i in range(n + 1100) if pattern.match(str(i))] == list(range(n))
    assert not any(pattern.match(s) for s in ("", "-1", "01", "00", " 1", "1.0", "1e2"))


@pytest.mark.slow
def test_every_schemathesis_check_passes_against_the_router_with_scripted_workers(model):
    app = make_app(model, api_keys=(KEY,), max_tokens=MAX_TOKENS, max_prompt_tokens=256)
    checks = all_checks()
    statuses: Counter = Counter()
    with TestClient(app):  # runs the lifespan: the handlers exist
        schema = load(app.openapi(), "tiny")
        schema.app = app
        for operation in schema.get_all_operations():
            operation = operation.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.NEGATIVE and operation.path in ("/health", "/metrics"):
                    continue  # no parameter, no body, no auth: nothing in these requests can be made invalid

                @given(case=operation.as_strategy(mode))
                @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
                @seed(SEED)
                def fuzz(case, mode) -> None:
                    response = case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=checks)
                    statuses[(case.method, case.path, mode.value, response.status_code)] += 1

                fuzz(mode=mode)
    print("\nfuzzed (method, path, mode, status): count", dict(sorted(statuses.items())))
    assert statuses[("POST", "/v1/chat/completions", "positive", 200)]
    assert statuses[("POST", "/v1/completions", "positive", 200)]
