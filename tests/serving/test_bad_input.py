"""Bad requests through the real router: OpenAI-shaped 4xx, and the cluster is unaffected."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.integration

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def cluster(one_p_one_d):
    return one_p_one_d


def post(cluster, path: str, **kw) -> httpx.Response:
    return cluster.http.post(f"{cluster.router_url}{path}", **kw)


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param != "any":
        assert err["param"] == param
    assert resp.headers["x-request-id"].startswith("req-")
    return err


BAD_CHAT = [
    pytest.param({k: v for k, v in CHAT.items() if k != "messages"}, "messages", id="missing-messages"),
    pytest.param({k: v for k, v in CHAT.items() if k != "model"}, "model", id="missing-model"),
    pytest.param({**CHAT, "messages": []}, "messages", id="empty-messages"),
    pytest.param({**CHAT, "messages": "hi"}, "messages", id="messages-not-a-list"),
    pytest.param({**CHAT, "max_tokens": "many"}, "max_tokens", id="mistyped-max-tokens"),
    pytest.param({**CHAT, "max_tokens": 10**9}, "max_tokens", id="huge-max-tokens"),
    pytest.param({**CHAT, "temperature": 5}, "temperature", id="temperature-out-of-range"),
    pytest.param({**CHAT, "n": 17}, "n", id="n-17"),
    pytest.param({**CHAT, "top_logprobs": 2}, "top_logprobs", id="top-logprobs-without-logprobs"),
    pytest.param({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", id="top-logprobs-21"),
]


@pytest.mark.parametrize("body, param", BAD_CHAT)
def test_bad_chat_request_gets_400(served, body, param):
    err = assert_openai_error(post(served, "/v1/chat/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_malformed_json_gets_400(served):
    resp = post(served, "/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                headers={"content-type": "application/json"})
    assert "JSON" in assert_openai_error(resp, 400)["message"]


def test_prompt_beyond_the_context_gets_400(served):
    body = {"model": "tiny", "prompt": [5] * (MAX_MODEL_LEN + 10), "max_tokens": 1}
    err = assert_openai_error(post(served, "/v1/completions", json=body), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]


def test_max_tokens_0_without_echo_and_logprobs_beyond_20_are_refused(served):
    assert_openai_error(post(served, "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0}),
                        400, "max_tokens")
    assert_openai_error(post(served, "/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 21}),
                        400, "logprobs")


def test_unknown_model_gets_404_through_the_sdk(served):
    with pytest.raises(openai.NotFoundError) as info:
        served.client().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"


def test_unknown_route_gets_404(served):
    assert_openai_error(served.http.get(f"{served.router_url}/v1/engines"), 404)


def test_servers_still_answer_after_bad_input(served):
    r = served.client().chat.completions.create(**CHAT, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert all(s["healthy"] for s in served.http.get(f"{served.router_url}/health").json()["workers"])
