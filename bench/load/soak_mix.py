"""The soak's request mix: a steady blend of the API's request kinds, sent by client threads.

Kinds (each a small request against the router; prompts are 1 to ``max_words`` random words):

    chat          /v1/chat/completions, one user message
    stream_lp     /v1/completions, streamed, logprobs 2
    json          /v1/chat/completions with response_format json_object
    responses     /v1/responses
    n4            /v1/completions with n 4
    echo_lp       /v1/completions with echo and logprobs 1

A mix is written ``chat=3,stream_lp=2,json=1`` (weights; kinds left out are not sent). Every
outcome is counted by kind and by result (``ok``, or the HTTP status / ``stream_error`` /
``timeout`` / ``transport``); a client never stops on an error.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

KINDS = ("chat", "stream_lp", "json", "responses", "n4", "echo_lp")
DEFAULT_MIX = "chat=3,stream_lp=2,json=1,responses=1,n4=1,echo_lp=1"
WORDS = (
    "the quick brown fox jumps over lazy dog prefill decode server cache block token stream answer "
    "question model river mountain city paper green blue seven eleven light heavy small large tree "
    "house window garden music number letter water fire earth cloud north south east west"
).split()


def parse_mix(text: str) -> dict[str, float]:
    """``chat=3,n4=1`` -> {"chat": 3.0, "n4": 1.0}; ValueError naming a bad part."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, weight = part.partition("=")
        name = name.strip()
        if name not in KINDS or not sep:
            raise ValueError(f"bad mix part {part!r}: use KIND=WEIGHT with KIND one of {', '.join(KINDS)}")
        try:
            mix[name] = float(weight)
        except ValueError:
            raise ValueError(f"bad weight in mix part {part!r}") from None
        if mix[name] < 0:
            raise ValueError(f"bad weight in mix part {part!r}: must be >= 0")
    if not any(mix.values()):
        raise ValueError(f"mix {text!r} sends nothing")
    return mix


def request_for(kind: str, prompt: str, model: str, max_tokens: int) -> tuple[str, dict]:
    """The endpoint and body of one request of ``kind``."""
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    completion = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    match kind:
        case "chat":
            return "/v1/chat/completions", chat
        case "stream_lp":
            return "/v1/completions", {**completion, "stream": True, "logprobs": 2}
        case "json":
            return "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}
        case "responses":
            return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": max_tokens}
        case "n4":
            return "/v1/completions", {**completion, "n": 4, "temperature": 0.8}
        case "echo_lp":
            return "/v1/completions", {**completion, "echo": True, "logprobs": 1, "max_tokens": 2}
    raise ValueError(f"unknown kind {kind!r}")


def send(http: httpx.Client, url: str, path: str, body: dict) -> tuple[str, str]:
    """One request; its result (``ok``, an HTTP status, ``stream_error``, ``timeout`` or ``transport``)
    and, for an error, what was seen (a body's start, the exception)."""
    try:
        if not body.get("stream"):
            resp = http.post(url + path, json=body)
            return ("ok", "") if resp.status_code == 200 else (str(resp.status_code), resp.text[:300])
        with http.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                return str(resp.status_code), resp.read()[:300].decode(errors="replace")
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    return "ok", ""
                if line.startswith("data: ") and "error" in json.loads(line[len("data: ") :]):
                    return "stream_error", line[:300]
            return "stream_error", "cut before [DONE]"
    except httpx.TimeoutException as e:
        return "timeout", repr(e)
    except (httpx.HTTPError, ValueError) as e:
        return "transport", repr(e)


@dataclass
class Tally:
    """Outcomes by (kind, result), and when each error happened (monotonic) with what was seen."""

    counts: Counter = field(default_factory=Counter)
    errors_at: list[tuple[float, str, str]] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, result: str, at: float, detail: str = "") -> None:
        with self.lock:
            self.counts[(kind, result)] += 1
            if result != "ok":
                self.errors_at.append((at, kind, result))
                self.details.append(f"{kind} {result}: {detail}")

    def total(self) -> int:
        with self.lock:
            return sum(self.counts.values())

    def errors(self) -> int:
        with self.lock:
            return sum(n for (_, result), n in self.counts.items() if result != "ok")


class MixLoad:
    """``clients`` threads, each sending one request after another from ``mix`` until ``stop()``, waiting
    ``pause_s`` between a reply and its next request (0: none; a moderate load on a shared machine)."""

    def __init__(
        self,
        url: str,
        model: str,
        mix: dict[str, float],
        clients: int,
        *,
        max_words: int = 200,
        max_tokens: int = 16,
        timeout_s: float = 60.0,
        seed: int = 0,
        pause_s: float = 0.0,
        headers: dict[str, str] | None = None,
        make_client: Callable[[], httpx.Client] | None = None,
    ) -> None:
        self.url, self.model, self.max_words, self.max_tokens = url, model, max_words, max_tokens
        self.kinds = [k for k in KINDS if mix.get(k, 0) > 0]
        self.weights = [mix[k] for k in self.kinds]
        self.tally = Tally()
        self._timeout_s, self._seed, self._headers = timeout_s, seed, headers or {}
        self._pause_s = pause_s
        self._make_client = make_client
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"soak-client-{i}", daemon=True) for i in range(clients)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """No new request starts; waits for those in flight (each bounded by ``timeout_s``)."""
        self._stop.set()
        for t in self._threads:
            t.join(self._timeout_s + 10)

    def _run(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        make = self._make_client or (lambda: httpx.Client(timeout=self._timeout_s, headers=self._headers))
        with make() as http:
            while not self._stop.is_set():
                kind = rng.choices(self.kinds, self.weights)[0]
                prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, self.max_words)))
                path, body = request_for(kind, prompt, self.model, self.max_tokens)
                result, detail = send(http, self.url, path, body)
                self.tally.add(kind, result, time.monotonic(), detail)
                if self._pause_s:
                    self._stop.wait(self._pause_s)  # a client's think time; stop() ends it
