"""``GET /kv/events/stream?after=SEQ``: a server's block-hash events pushed to a router as they happen.

The router's cache index (router/cluster/kv_index.py) follows each server through one long-lived
response of NDJSON lines, each a ``KvEventsReply`` (the page ``GET /kv/events`` answers): first the
events after ``SEQ``, then every new batch as the engine thread adds it, and an empty page at least
every ``heartbeat_s`` so that a reader tells a quiet server from a dead one. A reader that finds a
page it cannot apply (a new epoch, or ``oldest`` past what it has: events it missed) loads
``GET /kv/blocks`` and opens the stream again after that snapshot's seq.

Why a stream over the server's own HTTP port rather than a message bus (ZeroMQ PUB/SUB, NATS): it
needs no other port, server or address to run, open or render for Kubernetes; the guard checks
the cluster's secret on it as on every internal route (block hashes tell what prompts were sent,
so a PUB socket anyone on the network could subscribe to would leak them); and each router gets
exactly the sequence it has not seen, numbered as the snapshot is, with no second protocol for the
gap. Each batch is encoded once per server and written to every open stream; nothing polls.

The engine thread adds events; ``Changes`` carries a wake-up to the event loop, at most one queued
at a time however many events come in a burst, and the events of the next ``BATCH_S`` join that
page: a router parses at most 10 pages a second from a busy server (it polled 5 times a second,
busy or idle: one empty page a second now) and sees the events about twice as soon.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from engine.kv_events import KvEventLog
from wire.replies import KvEventsReply

HEARTBEAT_S = 1.0  # an empty page this often on a quiet stream
BATCH_S = 0.1  # after a wake-up, the events of this long go out as one page (a page costs a parse each)
MAX_STREAMS = 64  # open streams per server (routers and their reconnects); one more gets 503


class Changes:
    """Wakes the streams of one event loop when ``log`` gets events, from any thread."""

    def __init__(self, log: KvEventLog, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queued = False
        self._waiters: set[asyncio.Future[None]] = set()
        self.streams = 0  # open now
        log.listen(self._from_any_thread)

    def _from_any_thread(self) -> None:
        if not self._queued:  # a burst of events is one wake-up
            self._queued = True
            with contextlib.suppress(RuntimeError):  # the loop closed (the server stops): no stream is left
                self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._queued = False
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def waiting(self) -> int:
        """Streams waiting for events now."""
        return len(self._waiters)

    async def wait(self, timeout: float) -> None:
        """Until events are added, or ``timeout`` s."""
        waiter = self._loop.create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            self._waiters.discard(waiter)


async def event_stream(
    log: KvEventLog,
    changes: Changes,
    after: int,
    *,
    block_size: int,
    salt: str,
    enabled: bool,
    heartbeat_s: float = HEARTBEAT_S,
    batch_s: float = BATCH_S,
    ended: Callable[[], bool] = lambda: False,
) -> AsyncIterator[bytes]:
    """NDJSON pages of ``log`` after ``after``: what it holds now, then each new batch, until closed
    or ``ended()`` (the server drains: the router follows it again if it comes back into rotation,
    and its shutdown does not wait for the stream)."""
    seq = after
    changes.streams += 1
    try:
        while not ended():
            page = log.since(seq)
            reply = KvEventsReply(
                epoch=page.epoch,
                oldest=page.oldest,
                last=page.last,
                events=page.events,
                block_size=block_size,
                salt=salt,
                enabled=enabled,
            )
            yield reply.model_dump_json().encode() + b"\n"
            if page.oldest > seq + 1:
                return  # events lost: the reader loads the snapshot and opens a new stream after it
            if page.events:
                seq = page.events[-1][0]
            if page.last > seq:
                continue  # a page was full: the rest at once
            await changes.wait(heartbeat_s)
            if log.since(seq, limit=1).last > seq:
                await asyncio.sleep(batch_s)  # the rest of the burst joins this page
    finally:
        changes.streams -= 1
