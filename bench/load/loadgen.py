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
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from bench.load.metrics import RequestRecord

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class PreparedRequest:
    """One request ready to send: ``prompt`` is text or token ids."""

    index: int
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int


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

    def __post_init__(self):
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

    def body(self, req: PreparedRequest) -> dict:
        body = {
            "model": self.model,
            "max_tokens": req.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == CHAT:
            if not isinstance(req.prompt, str):
                raise ValueError("the chat endpoint takes text prompts, not token ids")
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
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


async def send_request(client: httpx.AsyncClient, config: LoadConfig, req: PreparedRequest, t0: float) -> RequestRecord:
    """Sends one streaming request; times are seconds since ``t0``."""
    rec = RequestRecord(req.index, req.prompt_len, req.max_tokens, start=time.perf_counter() - t0)
    chat = config.endpoint == CHAT
    events = 0
    finished = False
    try:
        async with client.stream("POST", config.endpoint, json=config.body(req)) as resp:
            rec.request_id = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                await resp.aread()
                rec.error = f"HTTP {resp.status_code}{_error_type(resp.content)}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        finished = True
                        break
                    now = time.perf_counter() - t0
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.error = f"stream error{_error_type(data.encode())}"
                        break
                    if obj.get("usage"):
                        rec.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
                        rec.server_prompt_tokens = obj["usage"].get("prompt_tokens")
                    if _is_token_event(obj, chat):
                        rec.token_times.append(now)
                        events += 1
                    choices = obj.get("choices") or []
                    if choices and choices[0].get("finish_reason"):
                        finished = True
                if rec.error is None and not finished:
                    rec.error = "incomplete stream"
    except httpx.TimeoutException:
        rec.error = "timeout"
    except httpx.HTTPError as exc:
        rec.error = f"connection error: {type(exc).__name__}"
    except (json.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
        rec.error = f"bad response: {type(exc).__name__}"
    rec.end = time.perf_counter() - t0
    if rec.error is None and not rec.token_times:
        rec.error = "no tokens"
    rec.ok = rec.error is None
    if rec.ok and rec.output_tokens == 0:
        rec.output_tokens = events  # server sent no usage: one token per chunk
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
) -> LoadResult:
    """Runs the load test; ``next_request(i)`` builds the i-th request.

    ``transport`` replaces the network (tests pass an ``httpx.MockTransport``).
    """
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
            await send_request(client, config, next_request(-1 - i), time.perf_counter())
        t0 = time.perf_counter()
        records: list[RequestRecord] = []

        def record(rec: RequestRecord) -> None:
            records.append(rec)
            if on_done is not None:
                on_done(rec)

        if config.rate is None:
            await _closed_loop(client, config, next_request, record, t0)
        else:
            await _open_loop(client, config, next_request, record, t0)
        duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return LoadResult(records, duration)


def _more(config: LoadConfig, issued: int, t0: float) -> bool:
    if config.num_requests is not None:
        return issued < config.num_requests
    return time.perf_counter() - t0 < config.duration


async def _closed_loop(client, config, next_request, record, t0) -> None:
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while _more(config, issued, t0):
            req = next_request(issued)
            issued += 1
            record(await send_request(client, config, req, t0))

    await asyncio.gather(*(worker() for _ in range(config.concurrency or 1)))


async def _open_loop(client, config, next_request, record, t0) -> None:
    rng = np.random.default_rng(config.seed + 7919)
    gate = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    tasks = []
    arrival, issued = 0.0, 0

    async def one(req: PreparedRequest) -> None:
        try:
            record(await send_request(client, config, req, t0))
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
