"""Request migration on a real 1P2D: the decode server holding a request is killed with kill -9
after it streamed k tokens (the engine thread paused there by ``pause_after_tokens``, so k is
exact), and the request goes on on the other decode server. For greedy and seeded sampling, chat
and completions, streamed and not, with a JSON schema, log-probabilities, n = 2 and min_tokens,
the answer equals the same request never migrated (greedy: transformers' float32 output), the
stream is one unbroken stream with one id, usage is counted once, and afterwards every block on
every server is free. Then the outcomes with nothing to migrate to: both decode servers killed
(a clear error in the stream), and a client that leaves while its request migrates (nothing
leaked). Last, draining with ``drain: migrate``: a decode server drained through the router's
admin API, and one sent SIGTERM, hand their streams to the other decode server at once; a prefill
server sent SIGTERM mid-transfer finishes that transfer before it exits. Decode-to-prefill reuse is on
(``transfer.pull_prefix``, every read asked for): a decode server killed while the prefill server is about to
read its cached prefix makes that read a counted miss, and the request ends on the other decode server; so
does one killed while the read is in flight (``hold_reads``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import jsonschema
import pytest

from tests.engine.oracle import hf_greedy
from tests.faults.harness import FaultCluster, fault_config
from tests.support.oracle import expected_chat, expected_completion, tokenizer
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPT = "Once upon a time there was a small model that wanted to serve many users at once"
MESSAGES = [{"role": "user", "content": "Tell me about reserved blocks, leases and checksums."}]
WAIT_S = 60.0
USAGE = {"stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("migration")
    changes = {
        "router": {"health_interval_s": 0.5, "health_backoff_max_s": 1.0},
        "transfer": {"pull_prefix": True, "pull_prefix_margin": 0},  # every read asked for, whatever it costs
    }
    c = FaultCluster(fault_config(folder, tiny_model, 1, 2, changes), folder)
    yield c
    c.stop()


class Call(threading.Thread):
    """One request to the router; a streamed one's events are kept as they come."""

    def __init__(self, url: str, endpoint: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.endpoint, self.body = url, endpoint, body
        self.events: list[dict] = []
        self.done = False  # data: [DONE] came
        self.reply: dict | None = None
        self.status = 0
        self.leave = threading.Event()  # set: the client hangs up

    def run(self) -> None:
        url = f"{self.url}/v1/{self.endpoint}"
        with httpx.Client(timeout=WAIT_S) as http:
            if not self.body.get("stream"):
                resp = http.post(url, json=self.body)
                self.status, self.reply = resp.status_code, resp.json()
                return
            with http.stream("POST", url, json=self.body) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if self.leave.is_set():
                        return
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[len("data: ") :]))

    @property
    def streamed_text(self) -> int:
        """Chunks that carried generated text or tokens so far."""
        return sum(
            1 for e in self.events for c in e.get("choices", []) if c.get("text") or c.get("delta", {}).get("content")
        )


def answer(call: Call) -> dict:
    """The client's view: per choice its text, finish reason and tokens' log-probabilities; the ids; the usage."""
    assert call.status == 200, (call.status, call.reply, call.events)
    if call.reply is not None:
        chunks = [call.reply]
    else:
        assert call.done, f"stream cut: {call.events[-3:]}"
        assert not [e for e in call.events if "error" in e], call.events
        chunks = call.events
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.get("choices", []):
            got = choices.setdefault(c["index"], {"text": "", "finish": None, "logprobs": []})
            got["text"] += c.get("text") or (c.get("message") or c.get("delta") or {}).get("content") or ""
            got["finish"] = c.get("finish_reason") or got["finish"]
            lp = c.get("logprobs") or {}
            if "content" in lp:  # chat
                got["logprobs"] += [(t["token"], t["logprob"]) for t in lp["content"] or []]
            elif lp.get("tokens"):
                got["logprobs"] += list(zip(lp["tokens"], lp["token_logprobs"]))
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return {"ids": {c["id"] for c in chunks}, "choices": choices, "usage": usage[-1] if usage else None}


def same(got: dict, want: dict) -> None:
    assert len(got["ids"]) == 1
    assert {i: (c["text"], c["finish"]) for i, c in got["choices"].items()} == {
        i: (c["text"], c["finish"]) for i, c in want["choices"].items()
    }
    for i, c in want["choices"].items():
        assert [t for t, _ in got["choices"][i]["logprobs"]] == [t for t, _ in c["logprobs"]]
        assert [lp for _, lp in got["choices"][i]["logprobs"]] == pytest.approx(
            [lp for _, lp in c["logprobs"]], abs=2e-3
        )
    counted = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: whatever that server held
    assert {k: got["usage"][k] for k in counted} == {k: want["usage"][k] for k in counted}


def run(c: FaultCluster, endpoint: str, body: dict) -> Call:
    call = Call(c.router_url, endpoint, body)
    call.start()
    call.join(WAIT_S)
    return call


def migrations(c: FaultCluster) -> float:
    return c.metric("router", 'pdserve_router_migrations_total{cause="unreachable"}')


def paused(c: FaultCluster) -> str | None:
    return next((d for d in c.decode if c.alive(d) and c.faults(d)["stalled"]), None)


def start_paused(c: FaultCluster, endpoint: str, body: dict, k: int, pause_s: float = WAIT_S) -> tuple[Call, str]:
    """The request running, its decode server paused right after its k-th token (the other disarmed)."""
    for d in c.decode:
        c.arm(d, pause_after_tokens=k, pause_timeout_s=pause_s)
    call = Call(c.router_url, endpoint, body)
    call.start()
    wait_until(lambda: paused(c) is not None, WAIT_S, "a decode server paused after k tokens")
    victim = paused(c)
    for d in c.decode:
        if d != victim:
            c.arm(d)
    if body.get("stream"):
        wait_until(lambda: call.streamed_text >= 1, WAIT_S, "the client got its first tokens")
    return call, victim


def kill_and_restart(c: FaultCluster, *names: str) -> None:
    for name in names:
        c.kill(name)
    for name in names:
        c.restart(name)


def all_free(c: FaultCluster) -> None:
    c.wait_back(c.decode)
    leaked, view = c.leaked_blocks(WAIT_S)
    assert leaked == 0, view


CASES = [
    # (endpoint, body, k: "first" | "middle" | "last", greedy oracle)
    (
        "completions",
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "stream": True, **USAGE},
        "first",
    ),
    ("chat/completions", {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}, "middle"),
    (
        "completions",
        {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 2, "ignore_eos": True},
        "middle",
    ),
    (
        "chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 60,
            "temperature": 0.8,
            "seed": 17,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            **USAGE,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        },
        "middle",
    ),
    (
        "completions",
        {
            "prompt": PROMPT,
            "max_tokens": 14,
            "min_tokens": 14,
            "temperature": 0.9,
            "seed": 23,
            "stream": True,
            **USAGE,
        },
        "last",
    ),
]


def test_a_request_whose_decode_server_is_killed_after_k_tokens_ends_as_if_it_never_moved(cluster, tiny_model):
    c = cluster
    for endpoint, body, where in CASES:
        body = {"model": "tiny", **body}
        want = answer(run(c, endpoint, body))
        if body["temperature"] == 0:  # greedy: transformers float32
            oracle = (
                expected_completion(tiny_model, PROMPT, body["max_tokens"])
                if endpoint == "completions"
                else expected_chat(tiny_model, MESSAGES, body["max_tokens"])
            )
            assert want["choices"][0]["text"] == oracle[0]
        if "response_format" in body:
            jsonschema.validate(json.loads(want["choices"][0]["text"]), SCHEMA)
        total = want["usage"]["completion_tokens"]
        k = {"first": 1, "middle": max(1, total // 2), "last": total - 1}[where]
        before = migrations(c)
        call, victim = start_paused(c, endpoint, body, k)
        kill_and_restart(c, victim)
        call.join(WAIT_S)
        got = answer(call)
        same(got, want)
        assert migrations(c) == before + 1, (endpoint, where)
        all_free(c)


def test_with_no_decode_server_left_the_stream_ends_with_a_clear_error_and_nothing_leaks(cluster):
    c = cluster
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    call, first = start_paused(c, "completions", body, 3)
    other = next(d for d in c.decode if d != first)
    c.arm(other, pause_after_tokens=1, pause_timeout_s=WAIT_S)  # the request continues there, then pauses
    c.kill(first)
    wait_until(lambda: c.faults(other)["stalled"], WAIT_S, "the migrated request paused on the other server")
    c.kill(other)
    call.join(WAIT_S)
    assert call.done and call.status == 200
    errors = [e for e in call.events if "error" in e]
    assert len(errors) == 1 and "no other decode server could continue it" in errors[0]["error"]["message"]
    assert errors[0]["error"]["code"] == "unreachable"
    for name in (first, other):
        c.restart(name)
    all_free(c)

    # A client that leaves while its request moves (here off a server drained through the router, which
    # needs no restart): the new decode server drops it, nothing is held on either. The client hangs up at
    # the first line it reads after `leave`: the token the other server streams before it pauses, so it is
    # gone while that server still holds the request (released later, the request's last tokens would take
    # a few milliseconds, and the request could finish before the router saw the client go).
    call, first = start_paused(c, "completions", body, 2)
    other = next(d for d in c.decode if d != first)
    c.arm(other, pause_after_tokens=1, pause_timeout_s=WAIT_S)
    call.leave.set()
    c.http.post(f"{c.router_url}/admin/workers/{first}/drain").raise_for_status()
    wait_until(lambda: c.faults(other)["stalled"], WAIT_S, "the migrated request paused on the other server")
    call.join(WAIT_S)
    aborted = 'pdserve_requests_total{outcome="aborted"}'
    wait_until(lambda: c.metric(other, aborted) >= 1, WAIT_S, "the other server dropped the request of the client gone")
    for name in (first, other):
        c.release(name)
    c.http.post(f"{c.router_url}/admin/workers/{first}/resume").raise_for_status()
    all_free(c)
    assert c.metric(other, aborted) >= 1


def test_a_draining_decode_server_moves_its_streams_and_a_draining_prefill_server_finishes_its_transfer(
    cluster, tiny_model
):
    c = cluster
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, **USAGE}
    want = answer(run(c, "completions", body))
    draining = 'pdserve_router_migrations_total{cause="draining"}'

    # Through the router's admin API: the drain answers at once, the stream goes on elsewhere.
    before = c.metric("router", draining)
    call, victim = start_paused(c, "completions", body, 4)
    c.http.post(f"{c.router_url}/admin/workers/{victim}/drain").raise_for_status()
    call.join(WAIT_S)
    same(answer(call), want)
    assert c.metric("router", draining) == before + 1
    c.release(victim)
    c.http.post(f"{c.router_url}/admin/workers/{victim}/resume").raise_for_status()
    all_free(c)

    # SIGTERM (a Kubernetes pod after its preStop): the server ends its streams with "draining", the
    # router continues them on the other one, and the server exits without waiting for them.
    before = c.metric("router", draining)
    pause_s = 20.0  # while paused, a server that waited for its stream could not have ended
    call, victim = start_paused(c, "completions", body, 4, pause_s=pause_s)
    sent = time.monotonic()
    os.kill(c.proc(victim).popen.pid, signal.SIGTERM)
    call.join(WAIT_S)
    same(answer(call), want)
    assert c.metric("router", draining) == before + 1
    with contextlib.suppress(httpx.HTTPError):  # its engine thread goes on to its end; the server may be gone
        c.release(victim)
    assert c.proc(victim).popen.wait(WAIT_S) == -signal.SIGTERM  # drained, then ended by the signal, as always
    assert time.monotonic() - sent < pause_s  # it did not wait for its stream
    c.restart(victim)
    all_free(c)

    # A prefill server sent SIGTERM mid-transfer finishes the transfer it started, then exits.
    prompt = "A prefill server that leaves finishes what it started: " + "blocks and leases " * 4
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    (p0,) = c.prefill
    c.arm(p0, stall_after_layer=0, pause_timeout_s=WAIT_S)
    call = Call(c.router_url, "completions", body)
    call.start()
    wait_until(lambda: c.faults(p0)["stalled"], WAIT_S, "the prefill server stalled mid-transfer")
    os.kill(c.proc(p0).popen.pid, signal.SIGTERM)
    wait_until(lambda: c.http.get(f"{c.url(p0)}/health").json()["status"] == "draining", WAIT_S, "p0 draining")
    assert c.alive(p0)  # it waits for its transfer
    c.release(p0)
    call.join(WAIT_S)
    assert answer(call)["choices"][0]["text"] == expected_completion(tiny_model, prompt, 6)[0]
    assert c.proc(p0).popen.wait(WAIT_S) == -signal.SIGTERM
    c.restart(p0)
    c.wait_back([p0])
    all_free(c)


TURN_BODY = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
PULLS = {o: f'pdserve_kv_prefix_pulls_total{{outcome="{o}"}}' for o in ("ok", "unreachable")}


def turn_one(c: FaultCluster, tiny_model, seed: int) -> tuple[str, str, list[int]]:
    """Turn 1 of a conversation (``seed``: one no other test used, so p0 holds nothing of its answer), its
    answer checked against transformers': (the decode server that holds its prompt and answer, 96 tokens in
    6 blocks of 16; the other one; turn 2's prompt, 36 tokens of it beyond what p0 holds)."""
    first = [(29 * i + seed) % 400 + 40 for i in range(60)]
    ok = 'pdserve_requests_total{outcome="ok"}'
    served = {d: c.metric(d, ok) for d in c.decode}
    reply = answer(run(c, "completions", {**TURN_BODY, "prompt": first}))
    answer1 = hf_greedy(tiny_model, first, 40, ignore_eos=True)
    assert reply["choices"][0]["text"] == tokenizer(tiny_model).decode(answer1, skip_special_tokens=True)
    holder = next(d for d in c.decode if c.metric(d, ok) > served[d])
    other = next(d for d in c.decode if d != holder)
    return holder, other, first + answer1 + [(7 * i + 11) % 300 + 60 for i in range(20)]


def turn_two_ends_as_computed(c: FaultCluster, tiny_model, call: Call, second: list[int], before: dict) -> None:
    """Turn 2, whose read was an ``unreachable`` miss, answered with transformers' tokens."""
    call.join(WAIT_S)
    want = hf_greedy(tiny_model, second, 40, ignore_eos=True)
    assert answer(call)["choices"][0]["text"] == tokenizer(tiny_model).decode(want, skip_special_tokens=True)
    (p0,) = c.prefill
    assert c.metric(p0, PULLS["unreachable"]) == before["unreachable"] + 1
    assert c.metric(p0, PULLS["ok"]) == before["ok"]


def test_a_prefix_read_from_a_decode_server_killed_before_it_answers_is_a_miss_and_nothing_is_lost(cluster, tiny_model):
    """Turn 2 of a conversation is reserved on the decode server that holds turn 1's prompt and answer (the
    other one drained meanwhile); p0 holds its /prefill (``hold_prefill``) while that server is killed, so
    p0's read of the 36 tokens it lacks finds nobody: an ``unreachable`` miss. p0 computes the prompt, the
    router continues the request on the other decode server, the tokens equal transformers', and every
    block is back on every server once the killed one is restarted."""
    c = cluster
    (p0,) = c.prefill
    holder, other, second = turn_one(c, tiny_model, 53)
    before = {o: c.metric(p0, sample) for o, sample in PULLS.items()}

    c.http.post(f"{c.router_url}/admin/workers/{other}/drain").raise_for_status()  # turn 2 goes to holder
    c.arm(p0, hold_prefill=True, pause_timeout_s=WAIT_S)
    call = Call(c.router_url, "completions", {**TURN_BODY, "prompt": second})
    call.start()
    wait_until(lambda: c.faults(p0)["held"] == 1, WAIT_S, "p0 holds turn 2's prefill")
    c.http.post(f"{c.router_url}/admin/workers/{other}/resume").raise_for_status()
    c.kill(holder)
    c.release(p0)
    turn_two_ends_as_computed(c, tiny_model, call, second, before)
    c.restart(holder)
    all_free(c)


def test_a_decode_server_killed_during_a_prefix_read_makes_it_a_miss_and_nothing_is_lost(cluster, tiny_model):
    """As above, but the read is in flight when the decode server dies: it holds the read (``hold_reads``)
    with the 36 tokens copied out of its cache and its answer not sent, and is killed there. p0's open read
    breaks: an ``unreachable`` miss, p0 computes the prompt, the request ends on the other decode server
    with transformers' tokens, and every block is back on every server once the killed one is restarted."""
    c = cluster
    (p0,) = c.prefill
    holder, other, second = turn_one(c, tiny_model, 71)
    before = {o: c.metric(p0, sample) for o, sample in PULLS.items()}

    c.http.post(f"{c.router_url}/admin/workers/{other}/drain").raise_for_status()  # turn 2 goes to holder
    c.arm(holder, hold_reads=True, pause_timeout_s=WAIT_S)
    call = Call(c.router_url, "completions", {**TURN_BODY, "prompt": second})
    call.start()
    wait_until(lambda: c.faults(holder)["held_reads"] == 1, WAIT_S, "the holder holds p0's read")
    c.http.post(f"{c.router_url}/admin/workers/{other}/resume").raise_for_status()
    c.kill(holder)
    turn_two_ends_as_computed(c, tiny_model, call, second, before)
    c.restart(holder)
    all_free(c)
