"""Security through a real cluster: API keys on the router, the internal secret
on prefill/decode servers, request limits, and no secret in any log."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.guard.conftest import API_KEY, MAX_BODY, MAX_PROMPT, MAX_TOKENS, SECRET
from tests.support.oracle import PROMPTS, expected_completion

pytestmark = pytest.mark.integration

KEY = {"authorization": f"Bearer {API_KEY}"}
INTERNAL = {"authorization": f"Bearer {SECRET}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(guarded):
    return guarded


def sdk(cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key=key, max_retries=0)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize(
    "key", ["", "sk-wrong", API_KEY + "x", API_KEY[:-1]], ids=["none", "wrong", "longer", "shorter"]
)
def test_router_refuses_a_missing_or_wrong_key_with_401(idle_after, key):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    for method, path, body in (
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}),
    ):
        err = error_of(
            idle_after.http.request(method, f"{idle_after.router_url}{path}", json=body, headers=headers), 401
        )
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        sdk(idle_after, key or "none").chat.completions.create(**CHAT)


def test_router_answers_correctly_with_the_key(idle_after, tiny_model):
    text, _ = expected_completion(tiny_model, PROMPTS[0], MAX_TOKENS)
    r = sdk(idle_after, API_KEY).completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert r.choices[0].text == text


def test_health_and_metrics_need_no_key(idle_after):
    assert idle_after.http.get(f"{idle_after.router_url}/health").status_code == 200
    assert idle_after.http.get(f"{idle_after.router_url}/metrics").status_code == 200


INTERNAL_CALLS = {
    "decode": [
        ("POST", "/generate"),
        ("POST", "/abort"),
        ("POST", "/kv/hello"),
        ("POST", "/admin/drain"),
        ("POST", "/admin/resume"),
        ("GET", "/openapi.json"),
        ("GET", "/kv/events"),
        ("GET", "/kv/blocks"),
    ],
    "prefill": [
        ("POST", "/prefill"),
        ("POST", "/abort"),
        ("POST", "/admin/drain"),
        ("POST", "/admin/resume"),
        ("GET", "/openapi.json"),
        ("GET", "/kv/events"),
        ("GET", "/kv/blocks"),
    ],
}


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer nope"}, KEY, {"authorization": SECRET}, {"x-api-key": SECRET}],
    ids=["none", "wrong", "api-key", "no-bearer", "other-header"],
)
def test_internal_endpoints_refuse_calls_without_the_secret(idle_after, headers):
    for server in idle_after.servers:
        for method, path in INTERNAL_CALLS[server["role"]]:
            resp = idle_after.http.request(method, f"{server['url']}{path}", json={"request_id": "x"}, headers=headers)
            assert resp.status_code == 401, (server["name"], path, resp.text)
            assert resp.json() == {"error": "missing or wrong internal secret", "code": "unauthorized"}
        assert idle_after.http.get(f"{server['url']}/health").json()["status"] == "ok"  # probes stay open


def test_internal_endpoints_take_calls_with_the_secret(idle_after):
    for server in idle_after.servers:
        resp = idle_after.http.post(f"{server['url']}/abort", json={"request_id": "nobody"}, headers=INTERNAL)
        assert resp.json() == {"request_id": "nobody", "aborted": False}


def test_admin_endpoints_need_the_internal_secret_not_an_api_key(idle_after):
    url = f"{idle_after.router_url}/admin/workers"
    assert idle_after.http.get(url, headers=KEY).status_code == 401
    assert idle_after.http.get(url).status_code == 401
    workers = idle_after.http.get(url, headers=INTERNAL).json()["workers"]
    assert [(w["name"], w["in_rotation"], w["max_inflight"]) for w in workers] == [("p0", True, 64), ("d0", True, 64)]


def test_a_body_over_the_limit_gets_413(idle_after):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    err = error_of(idle_after.http.post(f"{idle_after.router_url}/v1/chat/completions", json=big, headers=KEY), 413)
    assert err["code"] == "request_too_large" and str(MAX_BODY) in err["message"]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(2 * MAX_BODY // 4096):
            yield b" " * 4096

    resp = httpx.post(
        f"{idle_after.router_url}/v1/completions",
        content=chunks(),
        headers={**KEY, "content-type": "application/json"},
        timeout=10,
    )
    error_of(resp, 413)


def test_too_many_prompt_tokens_or_max_tokens_get_400_in_openai_shape(idle_after):
    url = f"{idle_after.router_url}/v1/completions"
    err = error_of(
        idle_after.http.post(url, json={"model": "tiny", "prompt": [5] * (MAX_PROMPT + 1)}, headers=KEY), 400
    )
    assert err["param"] == "prompt" and err["type"] == "invalid_request_error" and str(MAX_PROMPT) in err["message"]
    err = error_of(
        idle_after.http.post(url, json={"model": "tiny", "prompt": "x", "max_tokens": MAX_TOKENS + 1}, headers=KEY), 400
    )
    assert err["param"] == "max_tokens" and err["code"] == "invalid_value"
    body = {**CHAT, "max_tokens": None, "max_completion_tokens": MAX_TOKENS + 1}
    err = error_of(idle_after.http.post(f"{idle_after.router_url}/v1/chat/completions", json=body, headers=KEY), 400)
    assert err["param"] == "max_completion_tokens"


def test_a_request_without_max_tokens_gets_at_most_the_cap(idle_after):
    body = {**CHAT, "max_tokens": None, "ignore_eos": True}
    r = idle_after.http.post(f"{idle_after.router_url}/v1/chat/completions", json=body, headers=KEY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_no_secret_or_key_in_any_log_or_manifest(idle_after):
    idle_after.http.post(f"{idle_after.router_url}/v1/chat/completions", json=CHAT, headers=KEY)
    files = [p for p in idle_after.run_dir.iterdir() if p.suffix in (".log", ".json")]
    assert {p.name for p in files} >= {"launcher.log", "router.log", "p0.log", "d0.log", "cluster.json"}
    for path in files:
        text = path.read_text(errors="replace")
        assert SECRET not in text and API_KEY not in text, path
