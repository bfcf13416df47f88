"""The load client against a fake OpenAI server (httpx.MockTransport)."""

import asyncio
import json

import httpx
import pytest

from bench.load.loadgen import CHAT, LoadConfig, PreparedRequest, run_load


def fake_server(token_delay=0.002, seen=None):
    """Streams max_tokens one-word chunks; prompts 'fail', 'broken', 'garbage' misbehave."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if seen is not None:
            seen.append(body)
        prompt = body.get("prompt") or body["messages"][0]["content"]
        if prompt == "fail":
            return httpx.Response(503, json={"error": {"message": "busy", "type": "overloaded"}})
        chat = "messages" in body

        async def stream():
            if chat:
                yield f"data: {json.dumps({'choices': [{'delta': {'role': 'assistant', 'content': ''}}]})}\n\n".encode()
            for i in range(body["max_tokens"]):
                await asyncio.sleep(token_delay)
                if prompt == "broken" and i == 1:
                    return
                if prompt == "garbage":
                    yield b"data: {not json\n\n"
                    return
                last = i == body["max_tokens"] - 1
                text = "" if prompt == "partial" and i == 1 else f" w{i}"  # half a character
                choice = {"delta": {"content": text}} if chat else {"text": text}
                choice["finish_reason"] = "length" if last else None
                yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    return httpx.MockTransport(handler)


def source(prompts=None, max_tokens=4):
    def make(i):
        text = prompts[i % len(prompts)] if prompts else "hello"
        return PreparedRequest(i, text, 7, max_tokens)

    return make


def run(config, transport, src=None, **kw):
    return asyncio.run(run_load(config, src or source(), transport=transport, **kw))


def cfg(**kw):
    return LoadConfig(url="http://fake", model="m", **kw)


def test_closed_loop_times_every_token_of_every_request():
    done = []
    result = run(cfg(concurrency=3, num_requests=10), fake_server(), on_done=done.append)
    assert [r.index for r in result.records] == list(range(10))
    assert len(done) == 10
    for r in result.records:
        assert r.ok and r.output_tokens == 4 and len(r.token_times) == 4
        assert r.server_prompt_tokens == 7
        assert r.start < r.token_times[0] <= r.token_times[-1] <= r.end
    assert result.duration_s >= max(r.end for r in result.records)


def test_request_body_asks_for_exact_output_length_and_usage():
    seen = []
    run(cfg(concurrency=1, num_requests=1, extra_body={"top_k": 1}), fake_server(seen=seen))
    body = seen[0]
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["prompt"] == "hello"


def test_chat_endpoint_sends_messages_and_reads_deltas():
    seen = []
    result = run(cfg(endpoint=CHAT, concurrency=1, num_requests=2), fake_server(seen=seen))
    assert seen[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert all(r.ok and len(r.token_times) == 4 for r in result.records)


def test_a_token_with_empty_text_is_still_timed_but_the_chat_role_chunk_is_not():
    for endpoint in ("/v1/completions", CHAT):
        result = run(cfg(endpoint=endpoint, concurrency=1, num_requests=1), fake_server(), src=source(["partial"]))
        (r,) = result.records
        assert r.ok and len(r.token_times) == 4 and r.output_tokens == 4


def test_server_errors_are_counted_per_request_and_never_stop_the_run():
    prompts = ["hello", "fail", "broken", "garbage"]
    result = run(cfg(concurrency=2, num_requests=8), fake_server(), src=source(prompts))
    errors = [r.error for r in result.records]
    assert errors == [None, "HTTP 503 (overloaded)", "incomplete stream", "bad response: JSONDecodeError"] * 2
    assert [r.ok for r in result.records] == [True, False, False, False] * 2


def test_unreachable_server_is_a_connection_error_per_request():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    result = run(cfg(concurrency=1, num_requests=2), httpx.MockTransport(refuse))
    assert [r.error for r in result.records] == ["connection error: ConnectError"] * 2


def test_poisson_rate_sends_the_requested_count_in_parallel():
    result = run(cfg(rate=float("inf"), num_requests=6), fake_server(token_delay=0.02))
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    # All were in flight together: the whole run is about one request long.
    assert result.duration_s < 3 * 4 * 0.02


def test_rate_with_concurrency_cap_never_exceeds_the_cap():
    result = run(cfg(rate=float("inf"), concurrency=2, num_requests=6), fake_server(token_delay=0.01))
    spans = [(r.start, r.end) for r in result.records]
    for t, _ in spans:
        assert sum(1 for s, e in spans if s <= t < e) <= 2


def test_duration_mode_starts_no_request_after_the_deadline():
    result = run(cfg(concurrency=2, duration=0.15), fake_server(token_delay=0.01))
    assert len(result.records) >= 2
    assert all(r.start < 0.15 and r.ok for r in result.records)


def test_warmup_requests_are_not_measured():
    seen = []
    result = run(cfg(concurrency=1, num_requests=2), fake_server(seen=seen), warmup=3)
    assert len(seen) == 5 and len(result.records) == 2


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(), "exactly one of"),
        (dict(num_requests=1, duration=1.0), "exactly one of"),
        (dict(num_requests=0), "num-requests"),
        (dict(num_requests=1, rate=0), "rate"),
        (dict(duration=1.0, rate=float("inf")), "needs --concurrency"),
    ],
)
def test_bad_load_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        cfg(**kw)


def test_chat_endpoint_refuses_token_id_prompts():
    with pytest.raises(ValueError, match="text prompts"):
        cfg(endpoint=CHAT, num_requests=1).body(PreparedRequest(0, [1, 2], 2, 1))
