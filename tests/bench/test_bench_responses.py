"""Multi-turn chats continued from the server's own answers: /v1/responses with previous_response_id, or
the whole conversation as messages (bench/load/loadgen.py), their per-turn numbers (bench/load/metrics.py)
and the affinity comparison's tables (bench/compare/responses_affinity.py), against fake servers."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from bench.compare import responses_affinity
from bench.load.cluster import _alive
from bench.load.loadgen import CHAT, RESPONSES, LoadConfig, PreparedRequest, run_load
from bench.load.metrics import RequestRecord, Stats, TurnStats, per_turn
from bench.load.prefix_workload import PrefixWorkload
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.report import format_turns
from bench.load.serve import history_of, request_source
from bench.load.workload import LengthDist
from tests.bench.conftest import SocketFake
from tests.bench.helpers import parser


def words(text: str) -> int:
    return len(text.split())


class FakeServer:
    """/v1/responses and /v1/chat/completions, streamed. Answer n is ``max tokens`` words ``a{n}_{i}``.
    Responses are stored: a ``previous_response_id`` continues one, and its usage counts the stored
    conversation's words as cached (as if the same decode server answered). Input tokens are the
    conversation's words; a request ``fail(body)`` picks is a 500."""

    def __init__(self, fail=lambda body: False, events=None):
        self.fail = fail
        self.events = events  # replaces the Responses stream: a list of SSE payloads
        self.bodies: list[dict] = []
        self.stored: dict[str, list[dict]] = {}  # response id -> the conversation, its answer included

    def answer(self, path: str, body: dict) -> tuple[int, list[str]]:
        self.bodies.append(body)
        if self.fail(body):
            return 500, [json.dumps({"error": {"message": "boom", "type": "server_error"}})]
        n = len(self.bodies) - 1
        if path == RESPONSES:
            if self.events is not None:
                return 200, self.events
            history = self.stored[body["previous_response_id"]] if "previous_response_id" in body else []
            given = body["input"]
            turn = [{"role": "user", "content": given}] if isinstance(given, str) else given
            pieces = [f" a{n}_{i}" for i in range(body["max_output_tokens"])]
            conversation = history + turn + [{"role": "assistant", "content": "".join(pieces)}]
            rid = f"resp_{n}"
            self.stored[rid] = conversation
            usage = {
                "input_tokens": sum(words(m["content"]) for m in history + turn),
                "input_tokens_details": {"cached_tokens": sum(words(m["content"]) for m in history)},
                "output_tokens": len(pieces),
            }
            out = [json.dumps({"type": "response.created", "response": {"id": rid, "error": None}})]
            out += [json.dumps({"type": "response.output_text.delta", "delta": p}) for p in pieces]
            out.append(json.dumps({"type": "response.completed", "response": {"id": rid, "usage": usage}}))
            return 200, out
        pieces = [f" a{n}_{i}" for i in range(body["max_tokens"])]
        out = [json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]})]
        out += [json.dumps({"choices": [{"delta": {"content": p}, "finish_reason": None}]}) for p in pieces[:-1]]
        out.append(json.dumps({"choices": [{"delta": {"content": pieces[-1]}, "finish_reason": "length"}]}))
        usage = {
            "prompt_tokens": sum(words(m["content"]) for m in body["messages"]),
            "completion_tokens": len(pieces),
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        out += [json.dumps({"choices": [], "usage": usage}), "[DONE]"]
        return 200, out

    def transport(self) -> httpx.MockTransport:
        async def handler(request: httpx.Request) -> httpx.Response:
            status, payloads = self.answer(request.url.path, json.loads(request.content))
            if status != 200:
                return httpx.Response(status, content=payloads[0].encode())

            async def stream():
                for data in payloads:
                    await asyncio.sleep(0.001)
                    kind = json.loads(data).get("type") if data != "[DONE]" else None
                    yield ((f"event: {kind}\n" if kind else "") + f"data: {data}\n\n").encode()

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

        return httpx.MockTransport(handler)


def workload(turns=3, conversations=2) -> PrefixWorkload:
    return PrefixWorkload(
        "multi_turn", LengthDist.parse("6"), LengthDist.parse("3"), turns=turns, conversations=conversations
    )


def run(server: FakeServer, tokenizer_dir, endpoint=RESPONSES, history="previous-response", turns=3):
    w = workload(turns)
    source = request_source(w, PromptBuilder(load_tokenizer(tokenizer_dir)), "text", 0, chained=True)
    config = LoadConfig(
        url="http://fake",
        model="m",
        endpoint=endpoint,
        concurrency=2,
        num_requests=2 * turns,
        history=history,
        ignore_eos=False,
    )
    return asyncio.run(run_load(config, source, transport=server.transport())), source


def test_each_turn_sends_only_its_question_with_the_previous_turns_response_id(tiny_tokenizer_dir):
    server = FakeServer()
    result, source = run(server, tiny_tokenizer_dir)
    records = result.records
    assert all(r.ok for r in records) and [r.turn for r in records] == [0, 0, 1, 1, 2, 2]
    by_question = {b["input"]: b for b in server.bodies}
    for r in records:
        req = source(r.index)
        body = by_question[req.prompt]
        assert body["max_output_tokens"] == 3 and body["temperature"] == 0.0 and body["stream"] is True
        assert "ignore_eos" not in body and "max_tokens" not in body and "stream_options" not in body
        if r.turn == 0:
            assert "previous_response_id" not in body
        else:  # the response that answered the same chat's turn before
            previous = server.stored[body["previous_response_id"]]
            assert previous[-2]["content"] == source(r.index - 2).prompt
        # usage read from response.completed; the prompt length is the server's count of the conversation
        assert r.output_tokens == 3 and len(r.token_times) == 3 and r.ttft > 0 and r.tpot is not None
        assert r.server_prompt_tokens == r.prompt_len == 6 * (r.turn + 1) + 3 * r.turn
        assert r.cached_tokens == 9 * r.turn
    # a turn is sent once the one before it is answered
    for r in records[2:]:
        assert r.start >= records[r.index - 2].end


@pytest.mark.parametrize("endpoint", [RESPONSES, CHAT])
def test_with_messages_each_turn_sends_the_whole_conversation_with_the_servers_answers(tiny_tokenizer_dir, endpoint):
    server = FakeServer()
    result, source = run(server, tiny_tokenizer_dir, endpoint, "messages")
    assert all(r.ok for r in result.records)
    key = "input" if endpoint == RESPONSES else "messages"
    last = [b for b in server.bodies if len(b[key]) == 5]  # turn 2: two questions and answers, a question
    assert len(last) == 2 and not any("previous_response_id" in b for b in server.bodies)
    for body in last:
        messages = body[key]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
        # the answers are what the server streamed for the earlier turns of this chat
        first = next(i for i, b in enumerate(server.bodies) if b[key] == messages[:1])
        assert messages[1]["content"] == "".join(f" a{first}_{i}" for i in range(3))
    assert not any("ignore_eos" in b for b in server.bodies)  # as the comparison runs it, chat too
    assert [r.server_prompt_tokens for r in result.records] == [6, 6, 15, 15, 24, 24]


def test_a_failed_turn_fails_the_later_turns_of_its_chat_only(tiny_tokenizer_dir):
    w = workload()
    builder = PromptBuilder(load_tokenizer(tiny_tokenizer_dir))
    broken = request_source(w, builder, "text", 0, chained=True)(2).prompt  # chat 0, turn 1
    server = FakeServer(fail=lambda body: body["input"] == broken)
    result, _ = run(server, tiny_tokenizer_dir)
    errors = [r.error for r in result.records]
    assert errors == [None, None, "HTTP 500 (server_error)", None, "an earlier turn failed", None]
    assert len(server.bodies) == 5  # the last turn of chat 0 was never sent


@pytest.mark.parametrize(
    "events, error, output_tokens",
    [
        ([json.dumps({"type": "error", "code": "boom", "message": "no"})], "stream error (boom)", 0),
        ([json.dumps({"type": "response.output_text.delta", "delta": " x"})], "incomplete stream", 0),
        (
            [json.dumps({"type": "response.output_text.delta", "delta": d}) for d in (" x", " y")]
            + [json.dumps({"type": "response.completed", "response": {"id": "r"}})],
            None,
            2,  # no usage: one token per delta
        ),
    ],
)
def test_responses_stream_errors_and_missing_usage(events, error, output_tokens):
    server = FakeServer(events=events)
    config = LoadConfig(url="http://fake", model="m", endpoint=RESPONSES, concurrency=1, num_requests=1)
    result = asyncio.run(run_load(config, lambda i: PreparedRequest(i, "hi", 1, 4), transport=server.transport()))
    (r,) = result.records
    assert r.error == error and r.output_tokens == output_tokens
    assert server.bodies[0]["input"] == "hi"  # no turn: a plain request


def test_per_turn_aggregates_latency_and_the_servers_token_counts():
    def rec(index, turn, ttft, inp, cached, ok=True):
        r = RequestRecord(index, inp, 4, start=0.0, end=ttft + 0.3, turn=turn, ok=ok)
        r.token_times = [ttft, ttft + 0.1] if ok else []
        r.output_tokens, r.server_prompt_tokens, r.cached_tokens = 4, inp, cached
        return r

    records = [
        rec(0, 0, 0.1, 100, 0),
        rec(1, 0, 0.3, 100, 0),
        rec(2, 1, 0.2, 200, 150),
        rec(3, 1, 0.4, 200, 50),
        rec(4, 1, 9.0, 200, 200, ok=False),
        RequestRecord(5, 10, 4, start=0.0),  # no turn: left out
    ]
    t0, t1 = per_turn(records)
    assert (t0.turn, t0.completed, t0.failed, t1.completed, t1.failed) == (0, 2, 0, 2, 1)
    assert t0.ttft.p50 == pytest.approx(200.0) and t1.ttft.p50 == pytest.approx(300.0)
    assert t1.ttft.p99 == pytest.approx(398.0)
    assert (t1.input_tokens, t1.cached_tokens, t1.computed_tokens) == (400, 200, 200)
    assert t0.computed_share == 1.0 and t1.computed_share == 0.5
    assert TurnStats.from_json(json.loads(json.dumps(t1.to_json()))) == t1
    table = format_turns([t0, t1])
    assert "computed = input - cached" in table
    assert table.splitlines()[-1].split() == ["1", "2", "300.0", "398.0", "100.0", "200.0", "100.0", "50.0%"]


def test_turns_of_no_tokens_report_no_share():
    t = TurnStats(0, 0, 1, Stats.of([]), Stats.of([]), Stats.of([]), 0, 0, 0, 0)
    assert t.computed_share is None and format_turns([t]).splitlines()[-1].split()[-3:] == ["-", "-", "-"]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(endpoint=CHAT, history="previous-response"), "needs --endpoint /v1/responses"),
        (dict(history="messages"), "needs --endpoint"),
        (dict(endpoint=RESPONSES, history="tree"), "not one of"),
    ],
)
def test_histories_the_endpoint_cannot_send_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        LoadConfig(url="http://fake", model="m", num_requests=1, **kw)


def test_the_responses_endpoint_refuses_token_id_prompts():
    config = LoadConfig(url="http://fake", model="m", endpoint=RESPONSES, num_requests=1)
    with pytest.raises(ValueError, match="text prompts"):
        config.body(PreparedRequest(0, [1, 2], 2, 1))


def test_history_defaults_to_previous_response_on_responses_and_needs_multi_turn():
    args = parser().parse_args(["bench", "serve", "--endpoint", RESPONSES, "--multi-turn", "3"])
    assert history_of(args, workload()) == "previous-response"
    args = parser().parse_args(["bench", "serve", "--endpoint", CHAT, "--multi-turn", "3"])
    assert history_of(args, workload()) == "words"
    args = parser().parse_args(["bench", "serve", "--endpoint", CHAT, "--history", "messages"])
    with pytest.raises(ValueError, match="needs --multi-turn"):
        history_of(args, None)


def test_chained_prompts_are_the_new_question_and_name_their_chat(tiny_tokenizer_dir):
    w = workload()
    builder = PromptBuilder(load_tokenizer(tiny_tokenizer_dir))
    chained = request_source(w, builder, "text", 0, chained=True)
    whole = request_source(w, builder, "text", 0)
    for i in range(6):
        req, full = chained(i), whole(i)
        assert (req.conversation, req.turn) == w.position(i) == (i % 2, i // 2)
        assert full.prompt.endswith(req.prompt) and req.prompt_len == 6 and full.conversation is None
        assert full.turn == req.turn
    warm = chained(-1)
    assert warm.conversation is None and warm.turn is None and warm.prompt_len == 6
    with pytest.raises(ValueError, match="multi-turn"):
        request_source(PrefixWorkload("shared_prefix", w.question, w.output, shared_tokens=4), builder, chained=True)


def test_bench_serve_runs_multi_turn_chats_through_responses(tiny_tokenizer_dir, tmp_path, capsys):
    fake = FakeServer()
    server = SocketFake(tiny_tokenizer_dir, fake.answer, model_id="m")
    out = tmp_path / "run.json"
    try:
        args = parser().parse_args(
            [
                "bench",
                "serve",
                "--url",
                server.url,
                "--endpoint",
                RESPONSES,
                "--multi-turn",
                "3",
                "--conversations",
                "2",
                "--concurrency",
                "2",
                "--num-requests",
                "6",
                "--prompt-len",
                "6",
                "--output-len",
                "3",
                "--warmup",
                "1",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        assert args.func(args) == 0
    finally:
        server.close()
    assert len(fake.bodies) == 7 and "previous_response_id" not in fake.bodies[0]  # the warmup: alone
    data = json.loads(out.read_text())
    assert data["config"]["history"] == "previous-response" and data["summary"]["completed"] == 6
    turns = data["per_turn"]
    assert [(t["turn"], t["completed"], t["input_tokens"], t["cached_tokens"]) for t in turns] == [
        (0, 2, 12, 0),
        (1, 2, 30, 18),
        (2, 2, 48, 36),
    ]
    printed = capsys.readouterr().out
    assert "Per turn" in printed and "different prompt length" not in printed


def fake_run(name: str, rnd: int, ttfts: list[float], cached: int) -> dict:
    records = []
    for i, ttft in enumerate(ttfts):
        r = RequestRecord(i, 100, 16, start=0.0, end=ttft + 0.5, turn=i // 2, ok=True)
        r.token_times, r.output_tokens = [ttft], 16
        r.server_prompt_tokens, r.cached_tokens = 100 * (1 + i // 2), cached * (i // 2)
        records.append(r)
    counters = {k: 0.0 for s in responses_affinity.SERVERS for k in (f"{s}_prompt_computed", f"{s}_prefix_hits")}
    counters |= {"p0_prompt_computed": 400.0, "kv_bytes": 4e6}
    return {"variant": name, "round": rnd, "records": records, "duration_s": 1.0, "counters": counters}


def test_the_comparison_pools_rounds_and_puts_the_variants_side_by_side():
    affinity = [fake_run("affinity", 0, [0.1, 0.1, 0.1, 0.1], 80), fake_run("affinity", 1, [0.1] * 4, 80)]
    chat = [fake_run("chat", 0, [0.1, 0.1, 0.3, 0.3], 0), fake_run("chat", 1, [0.1, 0.1, 0.3, 0.3], 0)]
    variants = {"affinity": responses_affinity.pooled(affinity), "chat": responses_affinity.pooled(chat)}
    v = variants["affinity"]
    assert (v["completed"], v["failed"], v["round_ttft_p50_ms"]) == (8, 0, [pytest.approx(100.0)] * 2)
    assert v["prompt_computed_per_req"]["p0"] == 100.0 and v["kv_mb_per_req"] == 1.0
    assert [t["cached_tokens"] for t in v["per_turn"]] == [0, 320]
    results = {"workload": "w", "rounds": 2, "model": "tiny", "variants": json.loads(json.dumps(variants))}
    text = responses_affinity.report(results, "python3 -m bench.compare.responses_affinity --rounds 2")
    lines = text.splitlines()
    assert "| 1 | affinity | 100 / 100 | 200.0 | 80.0 | 60 % |" in lines
    assert "| 1 | chat | 300 / 300 | 200.0 | 0.0 | 100 % |" in lines
    assert "| 1 | 3.00x, 3.00x |" in lines and "| 0 | 1.00x, 1.00x |" in lines
    assert "no switch that turns the affinity off" in text
    assert any(
        line.startswith("| chat | 8 / 0 | 200 / 300 | 200, 200 | 16.0 | 100, 0, 0 | 1.000 MB |") for line in lines
    )


def test_the_comparison_says_what_it_does_and_refuses_unknown_variants(capsys):
    with pytest.raises(SystemExit) as done:
        responses_affinity.main(["--help"])
    assert done.value.code == 0
    assert "previous_response_id" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        responses_affinity.main(["--variants", "affinity,sticky"])
    assert done.value.code == 2 and "sticky" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_the_comparison_runs_chats_through_a_real_cluster_and_stops_it(tiny_model, tmp_path, capsys):
    out = tmp_path / "affinity"
    argv = ["--model", tiny_model, "--conversations", "2", "--turns", "2", "--rounds", "1", "--warmup-runs", "0"]
    assert responses_affinity.main([*argv, "--variants", "affinity", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    turns = data["variants"]["affinity"]["per_turn"]
    assert [(t["turn"], t["completed"], t["failed"]) for t in turns] == [(0, 2, 0), (1, 2, 0)]
    requests = data["requests"]["affinity"]
    assert all(0 < r["output_tokens"] <= 16 and r["ttft"] > 0 for r in requests)
    first, second = ([r for r in requests if r["turn"] == t] for t in (0, 1))
    assert all(r["cached_tokens"] == 0 for r in first)
    # the second turn went to the decode server that answered the first: it found the chat cached there
    assert all(r["cached_tokens"] > 0 and r["server_prompt_tokens"] > 64 + 64 for r in second)
    assert (out / "report.md").read_text().startswith("Workload: multi-turn 2 x 2 chats")
    manifest = json.loads((out / "round0" / "affinity" / "run" / "cluster.json").read_text())
    assert not any(_alive(p["pid"]) for p in manifest["processes"])
    assert os.path.isfile(out / "round0" / "affinity" / "1p2d.yaml")
