"""Test doubles for the router's unit tests only: a WorkerClient look-alike
that answers from a script, and the byte-level tokenizer of bench/stubs.py.
Integration tests use the real servers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from bench.stubs import make_byte_tokenizer  # noqa: F401  (the byte-level tokenizer the tests use)
from router.worker_client import WorkerFailed
from server_common.worker_replies import PrefillResult, Reservation, TokensEvent
from transfer.outcome import Outcome


@dataclass
class FakeStream:
    worker: object
    reservation: Reservation | None
    events_to_send: list[TokensEvent]
    delay: float = 0.0
    closed: bool = False
    num_cached_tokens: int = 0

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
            reservation = Reservation(instance=worker.name, request_id=req.request_id, transfer_id="t-" +
                                      req.request_id, block_ids=[0], block_size=16,
                                      num_tokens=len(req.prompt_token_ids), lease_deadline=0.0, kv_target={})
        n = min(len(self.reply), req.sampling.max_tokens)
        events = [TokensEvent(token_ids=[t]) for t in self.reply[:n]]
        reason = self.finish_reason if n == len(self.reply) else "length"
        events[-1] = TokensEvent(token_ids=events[-1].token_ids, finish_reason=reason)
        stream = FakeStream(worker, reservation, events, self.delay, num_cached_tokens=self.cached_tokens)
        self.streams.append(stream)
        return stream

    async def prefill(self, worker, req):
        self.prefills.append((worker.name, req))
        return PrefillResult(request_id=req.request_id, first_token_id=self.reply[0],
                             num_tokens=len(req.prompt_token_ids), transfer_bytes=0, seconds=0.0)

    async def abort(self, worker, request_id):
        self.aborts.append((worker.name, request_id))
