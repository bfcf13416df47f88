"""Test doubles for the router's unit tests only: a WorkerClient look-alike
that answers from a script, and the byte-level tokenizer of bench/micro/stubs.py.
Integration tests use the real servers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from bench.micro.stubs import make_byte_tokenizer  # noqa: F401  (the byte-level tokenizer the tests use)
from router.cluster.worker_client import WorkerFailed
from transfer.outcome import Outcome
from wire.replies import PrefillResult, Reservation, TokenLogprob, TokensEvent


def in_rotation(app):
    """``app`` (router.app.create_app) with its config's workers in rotation at once, as if their first
    health check had passed: fake workers answer no /health."""
    for worker in app.state.registry.workers:
        worker.healthy = True
    return app


def fake_logprob(position: int, top: int) -> TokenLogprob:
    """The fake servers' score of the token at ``position``: -(position + 1), top tokens 0, 1, ..."""
    return TokenLogprob(logprob=-(position + 1.0), top=[(k, -0.5 * (k + 1)) for k in range(top)])


def fake_prompt_logprobs(num_tokens: int, top: int) -> list[TokenLogprob | None]:
    return [None] + [fake_logprob(100 + i, top) for i in range(1, num_tokens)]


@dataclass
class FakeStream:
    worker: object
    reservation: Reservation | None
    events_to_send: list[TokensEvent]
    delay: float = 0.0
    closed: bool = False
    num_cached_tokens: int = 0
    request_id: str = ""  # the attempt id it was opened under

    async def events(self):
        for event in self.events_to_send:
            if self.delay:
                await asyncio.sleep(self.delay)
            yield event

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class FakeWorkerClient:
    """Answers every request with ``reply`` (token ids), one token per event."""

    reply: list[int]
    finish_reason: str = "stop"
    full: set[str] = field(default_factory=set)  # decode workers that answer "no room"
    delay: float = 0.0
    cached_tokens: int = 0  # what each decode stream says it found in its prefix cache
    opened: list[tuple[str, object]] = field(default_factory=list)
    prefills: list[tuple[str, object]] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)

    async def open_decode(self, worker, req):
        if worker.name in self.full:
            raise WorkerFailed.of(worker, "no free KV blocks", Outcome.NO_ROOM, never_reached=True, retry_after=2.0)
        self.opened.append((worker.name, req))
        reservation = None
        if not req.local_prefill:
            num_tokens = len(req.prompt_token_ids)
            reservation = Reservation(
                instance=worker.name,
                request_id=req.request_id,
                transfer_id="t-" + req.request_id,
                block_ids=list(range(num_tokens // 16 + 1)),
                block_size=16,
                num_tokens=num_tokens,
                lease_s=30,
                kv_target={"peer": worker.name},
            )
        events = [e for i in range(req.sampling.n) for e in self.sequence(req, i)]
        stream = FakeStream(
            worker, reservation, events, self.delay, num_cached_tokens=self.cached_tokens, request_id=req.request_id
        )
        self.streams.append(stream)
        return stream

    def sequence(self, req, index: int) -> list[TokensEvent]:
        """Sequence ``index``'s events: ``reply``, one token an event, each scored -(position + 1)
        (and the top ``logprobs`` tokens 0, 1, ...) when asked for; with a reservation the first
        token's log-probability comes from the prefill call, as a real decode server's does."""
        n = min(len(self.reply), req.sampling.max_tokens)
        sampling = req.sampling
        events = []
        for pos, t in enumerate(self.reply[:n]):
            logprobs = None
            if sampling.logprobs is not None and not (pos == 0 and not req.local_prefill):
                logprobs = [fake_logprob(pos, sampling.logprobs)]
            prompt = None
            if pos == 0 and index == 0 and req.local_prefill and sampling.prompt_logprobs is not None:
                prompt = fake_prompt_logprobs(len(req.prompt_token_ids), sampling.prompt_logprobs)
            reason = (self.finish_reason if n == len(self.reply) else "length") if pos == n - 1 else None
            events.append(
                TokensEvent(token_ids=[t], index=index, logprobs=logprobs, prompt_logprobs=prompt, finish_reason=reason)
            )
        return events

    async def prefill(self, worker, req):
        self.prefills.append((worker.name, req))
        sampling = req.sampling
        return PrefillResult(
            request_id=req.request_id,
            first_token_ids=[self.reply[0]] * sampling.n,
            num_tokens=len(req.prompt_token_ids),
            transfer_bytes=0,
            seconds=0.0,
            first_logprobs=None if sampling.logprobs is None else [fake_logprob(0, sampling.logprobs)] * sampling.n,
            prompt_logprobs=None
            if sampling.prompt_logprobs is None
            else fake_prompt_logprobs(len(req.prompt_token_ids), sampling.prompt_logprobs),
        )

    async def abort(self, worker, request_id):
        self.aborts.append((worker.name, request_id))
