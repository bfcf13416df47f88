"""The load client: streams OpenAI-API requests and times every token.

Two arrival modes, both bounded by a request count or a duration:

* closed loop (``concurrency`` only): that many requests are always in
  flight; each one finishing starts the next;
* open loop (``rate``): Poisson arrivals at ``rate`` per second, capped at
  ``concurrency`` in flight when both are given (extra arrivals wait).

In duration mode no request starts after ``duration`` seconds; those in
flight finish (each is bounded by ``request_timeout``). A server error, a
timeout or a broken stream marks that request failed with a short reason;
it never stops the run.

Multi-turn conversations can continue from the server's own answers
(``LoadConfig.history``): on ``/v1/responses`` each turn after the first sends
only its new question with the previous turn's ``previous_response_id``
("previous-response"); on chat or Responses, every turn so far as messages
("messages"). Either way turn t of a conversation is sent once turn t-1 has
been answered (``Conversations``); its TTFT is counted from when it is sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from bench.load.metrics import RequestRecord

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
ENDPOINTS = ("/v1/completions", CHAT, RESPONSES)
# How a turn carries the conversation before it: synthetic words in one prompt (bench/load/prefix_workload.py),
# every turn so far as messages with the server's answers, or the previous response's id (Responses only).
HISTORIES = ("words", "messages", "previous-response")


@dataclass(frozen=True)
class PreparedRequest:
    """One request ready to send: ``prompt`` is text or token ids."""

    index: int
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int
    turn: int | None = None  # the turn of its conversation (multi-turn workloads), from 0
    conversation: int | None = None  # set: the turn continues this conversation from the server's answers


@dataclass(frozen=True)
class Earlier:
    """What a conversation's next turn continues from: the last response's id (``/v1/responses``) and
    every turn so far as chat messages, the server's own answers included."""

    response_id: str | None = None
    messages: tuple[dict[str, str], ...] = ()

    def then(self, question: str, answer: str, response_id: str | None) -> Earlier:
        turn = ({"role": "user", "content": question}, {"role": "assistant", "content": answer})
        return Earlier(response_id, self.messages + turn)


class Conversations:
    """The conversations of one run: turn t is sent once turn t-1 is answered, and continues from it
    (``before``); a failed turn fails every later one of its conversation (``before`` gives None)."""

    def __init__(self) -> None:
        self._done: dict[tuple[int, int], Earlier | None] = {}
        self._waiting: dict[tuple[int, int], asyncio.Future] = {}

    async def before(self, req: PreparedRequest) -> Earlier | None:
        if not req.turn or req.conversation is None:
            return Earlier()
        key = (req.conversation, req.turn - 1)
        if key not in self._done:
            await self._waiting.setdefault(key, asyncio.get_running_loop().create_future())
        return self._done.pop(key)  # read once: by the next turn

    def after(self, req: PreparedRequest, earlier: Earlier | None) -> None:
        if req.conversation is None or req.turn is None:
            return
        key = (req.conversation, req.turn)
        self._done[key] = earlier
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass(frozen=True)
class LoadConfig:
    url: str
    model: str
    endpoint: str = "/v1/completions"
    concurrency: int | None = None
    rate: float | None = None
    num_requests: int | None = None
    duration: float | None = None
    request_timeout: float = 300.0
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None
    seed: int = 0
    history: str = "words"

    def __post_init__(self):
        if self.history not in HISTORIES:
            raise ValueError(f"history {self.history!r} is not one of {', '.join(HISTORIES)}")
        if self.history == "previous-response" and self.endpoint != RESPONSES:
            raise ValueError(f"--history previous-response needs --endpoint {RESPONSES}")
        if self.history == "messages" and self.endpoint not in (CHAT, RESPONSES):
            raise ValueError(f"--history messages needs --endpoint {CHAT} or {RESPONSES}")
        if (self.num_requests is None) == (self.duration is None):
            raise ValueError("give exactly one of --num-requests and --duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"--duration must be > 0, got {self.duration}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0 (or inf), got {self.rate}")
        if self.rate == math.inf and self.duration is not None and self.concurrency is None:
            raise ValueError("--rate inf with --duration needs --concurrency to bound it")

    def body(self, req: PreparedRequest, earlier: Earlier | None = None) -> dict:
        """The request's JSON; ``earlier``: what it continues (a turn of a conversation), if anything."""
        if self.endpoint == RESPONSES:
            return self._responses_body(req, earlier)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == CHAT:
            if not isinstance(req.prompt, str):
                raise ValueError("the chat endpoint takes text prompts, not token ids")
            history = list(earlier.messages) if earlier is not None else []
            body["messages"] = history + [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    def _responses_body(self, req: PreparedRequest, earlier: Earlier | None) -> dict:
        """No ``ignore_eos`` (not a Responses field): the answer is what the model gives, up to
        ``max_output_tokens``."""
        if not isinstance(req.prompt, str):
            raise ValueError("the Responses endpoint takes text prompts, not token ids")
        body: dict[str, Any] = {
            "model": self.model,
            "max_output_tokens": req.max_tokens,
            "temperature": self.temperature,
            "stream": True,
        }
        if earlier is not None and self.history == "messages":
            body["input"] = [*earlier.messages, {"role": "user", "content": req.prompt}]
        else:
            body["input"] = req.prompt
            if earlier is not None and earlier.response_id is not None:
                body["previous_response_id"] = earlier.response_id
        body.update(self.extra_body)
        return body


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float


def _is_token_event(obj: dict, chat: bool) -> bool:
    """Whether an SSE chunk carries generated output (its arrival is timed).

    As vLLM's benchmark: any completions chunk with a choice counts, even with
    empty text (a token whose bytes are not a whole character yet); for chat,
    a delta with content, but not the opening role-only delta.
    """
    choices = obj.get("choices") or []
    if not choices:
        return False
    if not chat:
        return "text" in choices[0]
    delta = choices[0].get("delta") or {}
    return delta.get("content") is not None and not (delta.get("role") and not delta.get("content"))


async def send_request(
    client: httpx.AsyncClient,
    config: LoadConfig,
    req: PreparedRequest,
    t0: float,
    conversations: Conversations | None = None,
) -> RequestRecord:
    """Sends one streaming request; times are seconds since ``t0``. A turn of a conversation
    (``req.conversation``) first waits for the turn before it in ``conversations``."""
    earlier = None
    if req.conversation is not None and conversations is not None:
        earlier = await conversations.before(req)
        if earlier is None:
            now = time.perf_counter() - t0
            rec = RequestRecord(req.index, req.prompt_len, req.max_tokens, start=now, end=now, turn=req.turn)
            rec.error = "an earlier turn failed"
            conversations.after(req, None)
            return rec
    stream = _Stream(config.endpoint)
    try:
        rec = await _send(client, config, req, t0, earlier, stream)
    finally:
        if conversations is not None and req.conversation is not None:
            ok = earlier is not None and stream.finished and stream.error is None
            answer = "".join(stream.text)
            conversations.after(req, earlier.then(str(req.prompt), answer, stream.response_id) if ok else None)
    return rec


class _Stream:
    """What one streamed answer said so far: its text, usage and end, per the endpoint's events."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.text: list[str] = []
        self.events = 0  # chunks that carried output
        self.finished = False
        self.error: str | None = None
        self.response_id: str | None = None
        self.output_tokens = 0
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None

    def feed(self, data: str) -> bool:
        """One ``data:`` payload; True when it carried output (its arrival is timed)."""
        if data == "[DONE]":
            self.finished = True
            return False
        obj = json.loads(data)
        if self.endpoint == RESPONSES:
            return self._responses_event(obj)
        if "error" in obj:
            self.error = f"stream error{_error_type(data.encode())}"
            return False
        usage = obj.get("usage")
        if usage:
            self.output_tokens = int(usage.get("completion_tokens") or 0)
            self.prompt_tokens = usage.get("prompt_tokens")
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        choices = obj.get("choices") or []
        if choices and choices[0].get("finish_reason"):
            self.finished = True
        if not _is_token_event(obj, self.endpoint == CHAT):
            return False
        if self.endpoint == CHAT:
            self.text.append(choices[0]["delta"].get("content") or "")
        else:
            self.text.append(choices[0].get("text") or "")
        return True

    def _responses_event(self, obj: dict) -> bool:
        """OpenAI's typed Responses events: output in ``response.output_text.delta``, the usage and the
        id in the final response (``response.completed``, or ``response.incomplete``)."""
        kind = obj.get("type")
        if kind == "response.output_text.delta":
            self.text.append(obj.get("delta") or "")
            return True
        if kind in ("error", "response.failed"):
            err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
            what = err.get("code") or err.get("type")
            self.error = "stream error" + (f" ({what})" if what and what != "error" else "")
        elif kind in ("response.completed", "response.incomplete"):
            response = obj.get("response") or {}
            usage = response.get("usage") or {}
            self.response_id = response.get("id")
            self.output_tokens = int(usage.get("output_tokens") or 0)
            self.prompt_tokens = usage.get("input_tokens")
            self.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            self.finished = True
        return False


async def _send(
    client: httpx.AsyncClient,
    config: LoadConfig,
    req: PreparedRequest,
    t0: float,
    earlier: Earlier | None,
    stream: _Stream,
) -> RequestRecord:
    rec = RequestRecord(req.index, req.prompt_len, req.max_tokens, start=time.perf_counter() - t0, turn=req.turn)
    try:
        async with client.stream("POST", config.endpoint, json=config.body(req, earlier)) as resp:
            rec.request_id = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                await resp.aread()
                stream.error = f"HTTP {resp.status_code}{_error_type(resp.content)}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    now = time.perf_counter() - t0
                    if stream.feed(data):
                        rec.token_times.append(now)
                        stream.events += 1
                    if stream.error is not None or data == "[DONE]":
                        break
                if stream.error is None and not stream.finished:
                    stream.error = "incomplete stream"
    except httpx.TimeoutException:
        stream.error = "timeout"
    except httpx.HTTPError as exc:
        stream.error = f"connection error: {type(exc).__name__}"
    except (json.JSONDecodeError, ValueError, TypeError, AttributeError, KeyError) as exc:
        stream.error = f"bad response: {type(exc).__name__}"
    rec.end = time.perf_counter() - t0
    rec.output_tokens = stream.output_tokens
    rec.server_prompt_tokens = stream.prompt_tokens
    rec.cached_tokens = stream.cached_tokens
    if req.conversation is not None and stream.prompt_tokens is not None:
        rec.prompt_len = stream.prompt_tokens  # the whole conversation, templated: only the server can count it
    if stream.error is None and not rec.token_times:
        stream.error = "no tokens"
    rec.error = stream.error
    rec.ok = rec.error is None
    if rec.ok and rec.output_tokens == 0:
        rec.output_tokens = stream.events  # server sent no usage: one token per chunk
    return rec


def _error_type(body: bytes) -> str:
    """`` (type)`` from an OpenAI-shaped error body, or nothing."""
    try:
        err = json.loads(body).get("error")
        kind = err.get("type") or err.get("code") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        return ""
    return f" ({kind})" if kind else ""


async def run_load(
    config: LoadConfig,
    next_request: Callable[[int], PreparedRequest],
    on_done: Callable[[RequestRecord], None] | None = None,
    warmup: int = 0,
    transport: httpx.AsyncBaseTransport | None = None,
    conversations: Conversations | None = None,
) -> LoadResult:
    """Runs the load test; ``next_request(i)`` builds the i-th request.

    ``transport`` replaces the network (tests pass an ``httpx.MockTransport``). ``conversations``:
    where turns of conversations find the ones before them (default: a new, empty one).
    """
    if conversations is None:
        conversations = Conversations()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.request_timeout, connect=min(30.0, config.request_timeout))
    # No connection cap: a request waiting for a pooled connection would count
    # the client's queueing as server latency.
    async with httpx.AsyncClient(
        base_url=config.url,
        headers=headers,
        timeout=timeout,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=config.concurrency or 64),
        transport=transport,
    ) as client:
        for i in range(warmup):
            await send_request(client, config, next_request(-1 - i), time.perf_counter(), conversations)
        t0 = time.perf_counter()
        records: list[RequestRecord] = []

        def record(rec: RequestRecord) -> None:
            records.append(rec)
            if on_done is not None:
                on_done(rec)

        if config.rate is None:
            await _closed_loop(client, config, next_request, record, t0, conversations)
        else:
            await _open_loop(client, config, next_request, record, t0, conversations)
        duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return LoadResult(records, duration)


def _more(config: LoadConfig, issued: int, t0: float) -> bool:
    if config.num_requests is not None:
        return issued < config.num_requests
    return time.perf_counter() - t0 < config.duration


async def _closed_loop(client, config, next_request, record, t0, conversations) -> None:
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while _more(config, issued, t0):
            req = next_request(issued)
            issued += 1
            record(await send_request(client, config, req, t0, conversations))

    await asyncio.gather(*(worker() for _ in range(config.concurrency or 1)))


async def _open_loop(client, config, next_request, record, t0, conversations) -> None:
    rng = np.random.default_rng(config.seed + 7919)
    gate = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    tasks = []
    arrival, issued = 0.0, 0

    async def one(req: PreparedRequest) -> None:
        try:
            record(await send_request(client, config, req, t0, conversations))
        finally:
            if gate is not None:
                gate.release()

    while _more(config, issued, t0):
        delay = arrival - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
            if not _more(config, issued, t0):
                break
        req = next_request(issued)
        if gate is not None:
            await gate.acquire()
        tasks.append(asyncio.create_task(one(req)))
        issued += 1
        if not math.isinf(config.rate):
            arrival += float(rng.exponential(1.0 / config.rate))
    await asyncio.gather(*tasks)
