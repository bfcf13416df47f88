"""The router's own logic against a scripted WorkerClient (no servers)."""

import json

import pytest
from fastapi.testclient import TestClient

from router.api.model import ServedModel
from router.app import create_app
from router.settings import RouterSettings
from tests.support.fakes import FakeWorkerClient, in_rotation, make_byte_tokenizer
from tests.support.router_client import WORKERS, make_client, reply_ids


def chat_body(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


def sse_payloads(text):
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_chat_non_streamed_goes_decode_first_then_prefill(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "héllo"))
    with make_client(model, fake) as c:
        r = c.post("/v1/chat/completions", json=chat_body(temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "héllo"}
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt = model.encode_chat([{"role": "user", "content": "hi"}])
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 6,
        "total_tokens": len(prompt) + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    ((d_name, greq),) = fake.opened
    ((p_name, preq),) = fake.prefills
    assert d_name == "d0" and p_name == "p0"
    assert greq.prompt_token_ids == prompt and not greq.local_prefill
    assert greq.sampling.temperature == 0 and greq.sampling.max_tokens == 64 - len(prompt)
    assert preq.reservation.transfer_id == f"t-{greq.request_id}"
    assert fake.aborts == []
    assert r.headers["x-request-id"].startswith("req-")


def test_chat_stream_has_role_chunk_content_finish_and_usage(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "ok€"))
    with make_client(model, fake) as c:
        r = c.post("/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == "ok€"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(ch["usage"] is None for ch in chunks[:-1])


def test_completion_stream_without_usage_option_has_no_usage_field(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "abc"), finish_reason="length")
    with make_client(model, fake) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True, "max_tokens": 3})
    chunks = sse_payloads(r.text)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "abc"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in ch for ch in chunks)


def test_stop_string_ends_the_request_and_aborts_it_on_both_servers(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "one, two, three"))
    with make_client(model, fake) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "count", "stop": [", t"]})
    body = r.json()
    assert body["choices"][0]["text"] == "one"
    assert body["choices"][0]["finish_reason"] == "stop"
    rid = fake.opened[0][1].request_id
    assert sorted(fake.aborts) == [("d0", rid), ("p0", rid)]


def test_short_prompt_is_prefilled_on_decode_below_threshold(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "a"))
    with make_client(model, fake, local_prefill_threshold=10) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "short"})
        assert r.status_code == 200
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "a prompt longer than ten"})
        assert r.status_code == 200
    assert [req.local_prefill for _, req in fake.opened] == [True, False]
    assert len(fake.prefills) == 1


def test_full_decode_server_is_skipped_and_all_full_is_429_with_retry_after(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "a"), full={"d0"})
    with make_client(model, fake) as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 200
        assert fake.opened[0][0] == "d1"
        fake.full.add("d1")
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "overloaded"


def test_arrivals_are_counted_before_admission_and_one_refused_for_want_of_a_slot_too(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "a"))
    with make_client(model, fake) as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "xy", "max_tokens": 5}).status_code == 200
        fake.full.update({"d0", "d1"})
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "xy", "max_tokens": 3}).status_code == 429
        text = c.get("/metrics").text
    assert "pdserve_router_arrived_requests_total 2.0" in text
    assert "pdserve_router_arrived_max_tokens_total 8.0" in text
    assert "pdserve_router_finished_max_tokens_total 5.0" in text  # the one that ran
    prompt = [line for line in text.splitlines() if line.startswith("pdserve_router_prompt_tokens_total")]
    arrived = [line for line in text.splitlines() if line.startswith("pdserve_router_arrived_prompt_tokens_total")]
    assert float(arrived[0].split()[-1]) == 2 * float(prompt[0].split()[-1])  # both came, one was admitted


@pytest.mark.parametrize(
    "body, status, param",
    [
        (chat_body(n=17), 400, "n"),
        (chat_body(n=0), 400, "n"),
        (chat_body(top_logprobs=2), 400, "top_logprobs"),
        (chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        (chat_body(prompt_logprobs=-1), 400, "prompt_logprobs"),
        (chat_body(messages=[]), 400, "messages"),
        (chat_body(max_tokens=10**6), 400, "max_tokens"),
        (chat_body(max_tokens=0), 400, "max_tokens"),
        (chat_body(temperature="hot"), 400, "temperature"),
        (chat_body(model="gpt-9"), 404, "model"),
        (chat_body(messages=[{"role": "user", "content": "x" * 100}]), 400, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
        (chat_body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    ],
)
def test_bad_chat_requests_get_openai_shaped_errors(model, body, status, param):
    fake = FakeWorkerClient(reply=[1])
    with make_client(model, fake) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["message"] and err["type"]
    assert fake.opened == []


def test_bad_completion_requests_get_400(model):
    fake = FakeWorkerClient(reply=[1])
    with make_client(model, fake) as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0}).status_code == 400
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 21}).status_code == 400
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": ["x", ""]}).status_code == 400
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": ""}).status_code == 400
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": [99999]}).status_code == 400
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert fake.opened == []


def test_models_lists_the_folder_as_root_and_unknown_route_is_404(model):
    with make_client(model, FakeWorkerClient(reply=[1])) as c:
        data = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["root"], m["max_model_len"]) for m in data] == [("tiny", model.root, 64)]
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_api_key_is_required_when_configured(model):
    with make_client(model, FakeWorkerClient(reply=[1]), api_keys=("sekret",)) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_metrics_count_requests(model):
    with make_client(model, FakeWorkerClient(reply=reply_ids(model, "hi"))) as c:
        c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        text = c.get("/metrics").text
    assert 'pdserve_router_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert 'pdserve_router_worker_healthy{role="decode",worker="d0"} 1.0' in text


@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_the_prompt_tokens_the_decode_server_found_cached(model, stream):
    fake = FakeWorkerClient(reply=reply_ids(model, "abc"), cached_tokens=32)
    body = {
        "model": "tiny",
        "prompt": "x" * 40,
        "max_tokens": 3,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    with make_client(model, fake) as c:
        r = c.post("/v1/completions", json=body)
    usage = sse_payloads(r.text)[-1]["usage"] if stream else r.json()["usage"]
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]) == (40, {"cached_tokens": 32})


def test_a_long_request_is_tokenized_on_the_tokenizer_thread_into_the_same_tokens(tmp_path):
    import asyncio
    import threading

    from router.api.api_requests import CompletionRequest
    from router.api.openai_handlers import LONG_REQUEST_BYTES, OpenAIHandlers
    from router.cluster.dispatch import Dispatcher, DispatchSettings
    from router.cluster.policies import RoundRobin
    from router.cluster.registry import WorkerRegistry
    from router.metrics import RouterMetrics

    model = ServedModel.load("tiny", str(make_byte_tokenizer(tmp_path, max_position_embeddings=4 * LONG_REQUEST_BYTES)))
    registry = WorkerRegistry([])
    dispatcher = Dispatcher(registry, RoundRobin(), RoundRobin(), None, DispatchSettings())  # asked for KV shares
    handlers = OpenAIHandlers(model, dispatcher=dispatcher, metrics=RouterMetrics(registry))
    threads = []

    def prepare(text):
        def run():
            threads.append(threading.current_thread().name)
            return handlers.prepare_completion(CompletionRequest(model="tiny", prompt=text, max_tokens=1), "r1")

        return run

    long_text = "héllo wörld " * (LONG_REQUEST_BYTES // 10)
    long = asyncio.run(handlers._prepare(prepare(long_text), len(long_text.encode())))
    short = asyncio.run(handlers._prepare(prepare("hi"), 2))
    assert long.prompts == [reply_ids(model, long_text)] and short.prompts == [reply_ids(model, "hi")]
    assert threads[0].startswith("tokenize") and threads[1] == threading.main_thread().name


SAMPLING_FIELDS = {
    "presence_penalty": 0.5,
    "frequency_penalty": -1.25,
    "repetition_penalty": 1.1,
    "logit_bias": {"66": 5.0, "3": -100},
    "min_tokens": 2,
    "stop_token_ids": [67, 0],
    "seed": 7,
    "user": "someone",
    "max_tokens": 3,
}


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat_body(**SAMPLING_FIELDS)),
        ("/v1/completions", {"model": "tiny", "prompt": "x", **SAMPLING_FIELDS}),
    ],
)
def test_sampling_fields_reach_the_decode_and_prefill_servers(model, path, body):
    fake = FakeWorkerClient(reply=reply_ids(model, "abc"))
    with make_client(model, fake) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    ((_, greq),) = fake.opened
    ((_, preq),) = fake.prefills
    for spec in (greq.sampling, preq.sampling):
        assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (0.5, -1.25, 1.1)
        assert spec.logit_bias == ((66, 5.0), (3, -100.0))
        assert (spec.min_tokens, spec.stop_token_ids, spec.seed, spec.max_tokens) == (2, (67, 0), 7, 3)


def test_sampling_fields_left_out_get_the_servers_defaults(model):
    from engine.request import SamplingParams

    fake = FakeWorkerClient(reply=reply_ids(model, "a"))
    with make_client(model, fake) as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3}).status_code == 200
    ((_, greq),) = fake.opened
    assert greq.sampling == SamplingParams(max_tokens=3)


VOCAB = 257  # the byte tokenizer: 256 bytes and <|eos|>


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": [5, 1]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 4, "max_tokens": 3}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
        ({"seed": "7"}, "seed"),
        ({"seed": 1 << 53}, "seed"),
        ({"seed": -(1 << 53)}, "seed"),
        ({"seed": 7.5}, "seed"),
        ({"user": 5}, "user"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stream": "true"}, "stream"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
    ],
)
def test_bad_sampling_fields_get_400_naming_the_field(model, fields, param):
    fake = FakeWorkerClient(reply=[1])
    with make_client(model, fake) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["type"]) == (param, "invalid_request_error")
    assert fake.opened == []


def test_best_of_equal_to_n_and_the_limits_of_each_range_are_accepted(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "a"))
    edges = {
        "best_of": 1,
        "presence_penalty": -2,
        "frequency_penalty": 2.0,
        "repetition_penalty": 100,
        "logit_bias": {str(i): -100 if i % 2 else 100 for i in range(VOCAB)},
        "min_tokens": 16,
        "stop_token_ids": [VOCAB - 1],
        "seed": (1 << 53) - 1,
        "top_k": 5.0,
    }
    with make_client(model, fake) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", **edges})
    assert r.status_code == 200, r.text
    assert len(fake.opened[0][1].sampling.logit_bias) == VOCAB


def test_a_model_is_retrieved_by_its_id_and_any_other_id_is_404_model_not_found(model):
    with make_client(model, FakeWorkerClient(reply=[1])) as c:
        card = c.get("/v1/models/tiny").json()
        (listed,) = c.get("/v1/models").json()["data"]
        others = [c.get(f"/v1/models/{other}") for other in ("gpt-4o", "org/tiny", "tiny/", "Tiny")]
    assert card == listed and (card["id"], card["object"], card["root"]) == ("tiny", "model", model.root)
    for r in others:
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["type"] == "not_found_error"


def test_a_model_id_with_a_slash_is_retrieved(model):
    settings = RouterSettings(model_path=model.root, served_model_name="org/tiny-v2", workers=WORKERS)
    served = ServedModel.load("org/tiny-v2", model.root)
    with TestClient(in_rotation(create_app(settings, model=served, client=FakeWorkerClient(reply=[1])))) as c:
        r = c.get("/v1/models/org/tiny-v2")
    assert r.status_code == 200 and r.json()["id"] == "org/tiny-v2"


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/v1/models/tiny", "GET"),
        ("POST", "/health", "GET"),
    ],
)
def test_a_method_the_route_does_not_allow_is_405_naming_the_allowed_ones(model, method, path, allow):
    with make_client(model, FakeWorkerClient(reply=[1])) as c:
        r = c.request(method, path)
    assert r.status_code == 405 and r.headers["allow"] == allow
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "method_not_allowed") and allow in err["message"]


def test_the_router_is_not_ready_and_admits_nothing_before_a_decode_server_passed_a_health_check(model):
    # Readiness and admission read one predicate: a decode server in rotation. The config's workers
    # enter rotation on their first passing check (these fake addresses never answer one), so the
    # router never says ready for a worker it has not seen.
    settings = RouterSettings(model_path=model.root, served_model_name="tiny", workers=WORKERS, queue_timeout_s=0.1)
    with TestClient(
        create_app(settings, model=model, client=FakeWorkerClient(reply=[1])), raise_server_exceptions=False
    ) as c:
        health = c.get("/health")
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    assert [w["in_rotation"] for w in health.json()["workers"]] == [False] * len(WORKERS)
    assert r.status_code == 503 and r.json()["error"]["message"] == "no healthy decode server"


def test_requests_are_prepared_and_answered_off_the_event_loop_by_their_size(model, monkeypatch):
    """A body's size decides, not its text: 1000 empty messages are templated on the tokenizer thread; an
    answer with log-probabilities is built and encoded on the answers thread."""
    import asyncio
    import threading

    import router.api.openai_handlers as handlers_module

    def where() -> str:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return threading.current_thread().name.split("_")[0]
        return "event loop"

    fake = FakeWorkerClient(reply=reply_ids(model, "abc"))
    prepared, answered = [], []
    encode = handlers_module.json_response
    monkeypatch.setattr(handlers_module, "json_response", lambda answer: answered.append(where()) or encode(answer))
    with make_client(model, fake) as c:
        handlers = c.app.state.handlers
        prepare = handlers.prepare_chat
        monkeypatch.setattr(handlers, "prepare_chat", lambda *a: prepared.append(where()) or prepare(*a))
        empty = c.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": ""}] * 1000))
        plain = c.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        scored = c.post("/v1/chat/completions", json=chat_body(max_tokens=3, logprobs=True, top_logprobs=2))
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "context_length_exceeded"
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] == "abc"
    assert scored.status_code == 200 and len(scored.json()["choices"][0]["logprobs"]["content"]) == 3
    assert prepared == ["tokenize", "event loop", "event loop"]
    assert answered == ["event loop", "answers"]


@pytest.mark.parametrize(
    "field, body, message",
    [
        (
            "messages",
            chat_body(messages=[{"role": "user", "content": ""}] * 100_000),
            "at most 8192 messages, not 100000",
        ),
        (
            "tools",
            chat_body(tools=[{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)]),
            "at most 128 tools, not 129",
        ),
    ],
)
def test_too_many_messages_or_tools_are_refused_before_any_is_read(model, field, body, message):
    fake = FakeWorkerClient(reply=reply_ids(model, "abc"))
    with make_client(model, fake) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field and message in r.json()["error"]["message"], r.json()
    assert not fake.opened
