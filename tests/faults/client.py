"""The client side of a fault test: concurrent completions through the router,
each judged against transformers' greedy answer.

Every request ends as exactly one of:

* ``correct``: HTTP 200 and the text equals transformers ``generate``;
* ``error``: a clear error: an HTTP error with an OpenAI error body, or a stream
  that carried an OpenAI error event and then ``data: [DONE]`` (text streamed
  before it must be a prefix of the right answer);
* ``left``: the test hung up on purpose (client disconnect);
* ``wrong``: anything else: a 200 with other text, a cut stream, a stream error
  after text that is not a prefix of the right answer, an error without the
  OpenAI shape, or no end within the deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

MAX_TOKENS = 10
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "Once upon a time there was a small model that wanted to serve many users at once",
    "A prefill server computes the prompt; a decode server streams the answer.",
    "Request four: tell me about reserved blocks, leases and checksums.",
    "Numbers one to ten: 1 2 3 4 5 6 7 8 9 10, and then what comes next?",
    "Café, naïve, über: multi-byte characters should survive the stream.",
    "The router retries once on another prefill server when one fails.",
    "Seven: kill -9 the decode server and see what the client gets back.",
]


@dataclass
class Outcome:
    kind: str  # correct | error | left | wrong
    stream: bool
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Call:
    """One request in flight; ``first_token`` is set once a streamed one received text."""

    prompt: str
    stream: bool
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    hung_up: bool = False


def is_openai_error(body) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and bool(body["error"].get("message"))


class Client:
    def __init__(self, router_url: str, expected: dict[str, str], deadline_s: float) -> None:
        self.url = f"{router_url}/v1/completions"
        self.expected = expected
        self.deadline_s = deadline_s
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(deadline_s + 5), limits=httpx.Limits(max_connections=64, max_keepalive_connections=0)
        )

    def start(self, prompt: str, stream: bool) -> Call:
        call = Call(prompt, stream)
        call.task = asyncio.create_task(self._run(call))
        return call

    def burst(self, n: int, offset: int = 0) -> list[Call]:
        """``n`` concurrent requests, every other one streamed."""
        return [self.start(PROMPTS[(offset + i) % len(PROMPTS)], stream=i % 2 == 0) for i in range(n)]

    async def hang_up(self, call: Call) -> None:
        call.hung_up = True
        call.task.cancel()
        await asyncio.gather(call.task, return_exceptions=True)

    async def outcomes(self, calls: list[Call]) -> list[Outcome]:
        return list(await asyncio.gather(*(self._outcome(c) for c in calls)))

    async def _outcome(self, call: Call) -> Outcome:
        try:
            return await call.task
        except asyncio.CancelledError:
            return Outcome("left" if call.hung_up else "wrong", call.stream, "cancelled")

    async def _run(self, call: Call) -> Outcome:
        started = time.monotonic()
        body = {
            "model": "tiny",
            "prompt": call.prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": call.stream,
        }
        try:
            async with asyncio.timeout(self.deadline_s):
                outcome = await (self._streamed(call, body) if call.stream else self._whole(body, call.prompt))
        except TimeoutError:
            outcome = Outcome("wrong", call.stream, f"no end within {self.deadline_s} s")
        except httpx.HTTPError as exc:
            outcome = Outcome("wrong", call.stream, f"transport error: {exc!r}")
        outcome.seconds = time.monotonic() - started
        return outcome

    async def _whole(self, body: dict, prompt: str) -> Outcome:
        resp = await self.http.post(self.url, json=body)
        try:
            data = resp.json()
        except ValueError:
            return Outcome("wrong", False, f"HTTP {resp.status_code}, not JSON: {resp.text[:200]}")
        if resp.status_code != 200:
            ok = is_openai_error(data) and resp.status_code >= 400
            return Outcome("error" if ok else "wrong", False, f"HTTP {resp.status_code}: {data}")
        text = data["choices"][0]["text"]
        if text == self.expected[prompt]:
            return Outcome("correct", False)
        return Outcome("wrong", False, f"got {text!r}, want {self.expected[prompt]!r}")

    async def _streamed(self, call: Call, body: dict) -> Outcome:
        want = self.expected[call.prompt]
        async with self.http.stream("POST", self.url, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    ok = is_openai_error(json.loads(raw))
                except ValueError:
                    ok = False
                return Outcome("error" if ok else "wrong", True, f"HTTP {resp.status_code}: {raw[:200]!r}")
            text, error, done = "", None, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    error = event
                    continue
                if event.get("choices"):
                    text += event["choices"][0]["text"] or ""
                    if text:
                        call.first_token.set()
        if not done:
            return Outcome("wrong", True, f"stream cut after {text!r}")
        if error is not None:
            ok = is_openai_error(error) and want.startswith(text)
            return Outcome("error" if ok else "wrong", True, f"stream error after {text!r}: {error}")
        if text == want:
            return Outcome("correct", True)
        return Outcome("wrong", True, f"got {text!r}, want {want!r}")

    async def aclose(self) -> None:
        await self.http.aclose()
