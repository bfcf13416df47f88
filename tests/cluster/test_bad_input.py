"""Bad requests through the real router: OpenAI-shaped 4xx, and the cluster is unaffected."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.cluster import MAX_MODEL_LEN

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
    pytest.param({**CHAT, "presence_penalty": 3}, "presence_penalty", id="presence-penalty-out-of-range"),
    pytest.param({**CHAT, "repetition_penalty": 0}, "repetition_penalty", id="repetition-penalty-zero"),
    pytest.param({**CHAT, "logit_bias": {"1": 500}}, "logit_bias", id="logit-bias-out-of-range"),
    pytest.param({**CHAT, "logit_bias": {"99999999": 1}}, "logit_bias", id="logit-bias-outside-vocabulary"),
    pytest.param({**CHAT, "stop_token_ids": [99999999]}, "stop_token_ids", id="stop-token-outside-vocabulary"),
    pytest.param({**CHAT, "min_tokens": 5}, "min_tokens", id="min-tokens-above-max-tokens"),
    pytest.param({**CHAT, "temperature": "0.5"}, "temperature", id="temperature-as-a-string"),
    pytest.param({**CHAT, "n": 17}, "n", id="n-17"),
    pytest.param({**CHAT, "top_logprobs": 2}, "top_logprobs", id="top-logprobs-without-logprobs"),
    pytest.param({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", id="top-logprobs-21"),
]


@pytest.mark.parametrize("body, param", BAD_CHAT)
def test_bad_chat_request_gets_400(served, body, param):
    err = assert_openai_error(post(served, "/v1/chat/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_malformed_json_gets_400(served):
    resp = post(
        served,
        "/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert "JSON" in assert_openai_error(resp, 400)["message"]


def test_prompt_beyond_the_context_gets_400(served):
    body = {"model": "tiny", "prompt": [5] * (MAX_MODEL_LEN + 10), "max_tokens": 1}
    err = assert_openai_error(post(served, "/v1/completions", json=body), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]


def test_max_tokens_0_without_echo_and_logprobs_beyond_20_are_refused(served):
    assert_openai_error(
        post(served, "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0}), 400, "max_tokens"
    )
    assert_openai_error(
        post(served, "/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 21}), 400, "logprobs"
    )


@pytest.mark.parametrize("fields", [{"best_of": 2}, {"suffix": "tail"}], ids=["best-of-2", "suffix"])
def test_best_of_other_than_n_and_suffix_are_refused(served, fields):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, **fields}
    assert_openai_error(post(served, "/v1/completions", json=body), 400, next(iter(fields)))


def test_the_servers_take_every_sampling_field_the_router_accepts(served, tiny_model):
    """Every sampling field reaches the engine: the answer equals the engine's own with the same
    SamplingParams, and those fields change it (the bias alone forces token 5)."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"5": 100, "7": -100},
        "min_tokens": 1,
        "stop_token_ids": [9],
        "seed": 3,
    }
    engine = LLMEngine(EngineConfig(model=tiny_model, num_blocks=64, num_threads=1))
    prompt = engine.tokenizer("hello").input_ids
    params = {**fields, "logit_bias": ((5, 100.0), (7, -100.0)), "stop_token_ids": (9,)}
    (offline,) = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, **params))
    (plain,) = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    assert offline.token_ids[0] == 5 and offline.token_ids != plain.token_ids
    r = served.client().completions.create(
        model="tiny", prompt="hello", max_tokens=4, temperature=0, extra_body={**fields, "user": "u-1", "best_of": 1}
    )
    assert (r.choices[0].text, r.usage.completion_tokens) == (offline.text, len(offline.token_ids))


def test_a_model_is_retrieved_through_the_sdk_and_another_id_is_404(served):
    assert served.client().models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        served.client().models.retrieve("org/other")
    assert info.value.body["code"] == "model_not_found"


def test_a_method_the_route_does_not_take_gets_405_with_allow(served):
    resp = served.http.get(f"{served.router_url}/v1/chat/completions")
    assert assert_openai_error(resp, 405)["code"] == "method_not_allowed" and resp.headers["allow"] == "POST"


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
