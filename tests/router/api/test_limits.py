"""The router's guards without servers: 413 for large bodies, 400 for prompts and
max_tokens over their caps, who may call the admin routes; nothing unpickled anywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from router.api.limits import RequestLimits
from router.api.model import ServedModel
from router.app import create_app
from router.errors import OpenAIError
from router.settings import RouterSettings, WorkerSpec
from server_common.guard import bearer_token, token_matches
from tests.support.fakes import FakeWorkerClient, in_rotation, make_byte_tokenizer

REPO = Path(__file__).resolve().parents[3]
WORKERS = (WorkerSpec("p0", "prefill", "http://p0"), WorkerSpec("d0", "decode", "http://d0"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return ServedModel.load("tiny", str(make_byte_tokenizer(tmp_path_factory.mktemp("bytetok"), 64)))


def client(model, **settings) -> TestClient:
    s = RouterSettings(model_path=model.root, served_model_name="tiny", workers=WORKERS, **settings)
    return TestClient(
        in_rotation(create_app(s, model=model, client=FakeWorkerClient(reply=[65, 66]))), raise_server_exceptions=False
    )


def test_bodies_over_the_limit_get_413_declared_or_streamed(model):
    with client(model, max_body_bytes=1024) as c:
        small = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, "pad": "y" * 900})
        declared = c.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 1100})
        streamed = c.post(
            "/v1/completions",
            content=iter([b"{" + b" " * 600, b" " * 600 + b"}"]),
            headers={"content-type": "application/json"},
        )
    assert small.status_code == 200
    for r in (declared, streamed):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert r.headers["x-request-id"].startswith("req-")


def test_prompt_and_max_tokens_caps(model):
    limits = RequestLimits(max_prompt_tokens=10, max_tokens=5)
    with pytest.raises(OpenAIError) as info:
        limits.completion_budget(model, 11, 1, "prompt")
    assert (info.value.status, info.value.param, info.value.code) == (400, "prompt", "invalid_value")
    with pytest.raises(OpenAIError) as info:
        limits.completion_budget(model, 3, 6, "messages", "max_completion_tokens")
    assert (info.value.status, info.value.param) == (400, "max_completion_tokens")
    assert limits.completion_budget(model, 3, 16, "prompt", explicit=False) == 5  # the API's default, lowered
    assert limits.completion_budget(model, 3, None, "messages") == 5
    assert RequestLimits(max_tokens=5).completion_budget(model, 62, None, "messages") == 2  # the context is tighter
    assert RequestLimits().completion_budget(model, 3, None, "messages") == 61


def test_the_router_applies_the_caps_in_openai_shape(model):
    with client(model, max_prompt_tokens=30, max_tokens=1) as c:
        long_prompt = c.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 31})
        default_max = c.post("/v1/completions", json={"model": "tiny", "prompt": "12"})
        big_max = c.post(
            "/v1/chat/completions",
            json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["param"] == "prompt"
    assert default_max.status_code == 200 and default_max.json()["usage"]["completion_tokens"] == 1
    assert big_max.status_code == 400 and big_max.json()["error"]["param"] == "max_tokens"


def test_admin_routes_need_the_secret_or_a_key_or_a_caller_on_this_machine(model):
    with client(model) as c:  # TestClient's caller is "testclient", not a loopback address
        refused = c.post("/admin/workers/d0/drain")
    assert refused.status_code == 403 and "internal_secret" in refused.json()["error"]["message"]
    with client(model, internal_secret="s" * 16, api_keys=("k",)) as c:
        assert c.get("/admin/workers", headers={"authorization": "Bearer k"}).status_code == 401
        drained = c.post("/admin/workers/d0/drain", headers={"authorization": "Bearer " + "s" * 16})
        unknown = c.post("/admin/workers/d9/drain", headers={"authorization": "Bearer " + "s" * 16})
    assert drained.status_code == 200 and drained.json()["draining"] and not drained.json()["in_rotation"]
    assert unknown.status_code == 404 and "d9" in unknown.json()["error"]["message"]


def test_bearer_tokens_are_parsed_and_compared_exactly():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("abc") == "" and bearer_token("Basic abc") == "" and bearer_token("") == ""
    assert token_matches("abc", ["x", "abc"])
    assert not token_matches("", [""]) and not token_matches("ab", ["abc"]) and not token_matches("abcd", ["abc"])


UNSAFE = re.compile(
    r"\bimport pickle\b|\bpickle\.|\bcloudpickle\b|\bdill\b|recv_pyobj|\bmarshal\.loads|"
    r"allow_pickle\s*=\s*True|yaml\.load\(|yaml\.unsafe_load|torch\.load\("
)


def test_nothing_is_unpickled_anywhere_in_the_product():
    """Wire formats are JSON (pydantic), msgpack (msgspec) and raw tensor bytes; weights are safetensors."""
    packages = [
        "engine",
        "transfer",
        "prefill_server",
        "decode_server",
        "router",
        "server_common",
        "kvlink",
        "wire",
        "deploy",
        "bench",
    ]
    hits = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for package in packages
        for path in sorted((REPO / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if UNSAFE.search(line)
    ]
    assert hits == []
