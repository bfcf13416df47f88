"""Background responses (``background: true`` on ``/v1/responses``): generation owned by the router, not by a request.

``POST /v1/responses`` answers at once with the response ``queued``; a task of the router's (``BackgroundRuns``)
runs it exactly as a streamed response runs, and keeps its events (the same typed events, numbered by
``sequence_number`` from 0) in the response store's event log (router/api/response_store/), beside its row,
so that any router sharing the store serves them:

- ``GET /v1/responses/{id}``: the row; its status goes queued -> in_progress -> completed (or incomplete,
  failed, cancelled), with the output once it ends;
- ``GET /v1/responses/{id}?stream=true&starting_after=N``: the events numbered above N, the stored ones and
  then the live ones until the last (``response.completed``, ``response.incomplete``, ``response.failed``;
  a cancelled response's stream just ends), each once, in order;
- ``POST /v1/responses/{id}/cancel``: stops it as a client's disconnect stops a stream (its sessions are
  closed, so the servers free its work and KV blocks) and answers it ``cancelled``; a response that has
  ended answers its final state. On another router it is asked through the store, and the router running
  it stops it at its next write (at most ``CANCEL_POLL_S`` later).

One writer per response writes its row changes and events in the order they happened, batching whatever
piled up during the previous write. The log is bounded (``EventLimits``, from ``router.response_store``):
a response whose events would pass ``max_events`` (the closing one counted) or ``max_bytes`` (the closing
one, which carries the whole response, not counted) stops there, its work on the servers freed, and ends
``failed`` (error ``server_error`` naming the limits); the events up to there stay, ``response.failed`` last.

The task is the router's: a router that stops ends its responses ``failed``. While it runs one it renews
a lease on it in the store (``RENEW_S``, ``LEASE_S``); a router killed stops renewing, and its decode
servers free the sequences when its connections drop. The first read of such a response on any router once
the lease has lapsed (a poll, or a stream waiting for its next event) takes the lease (one compare-and-set:
exactly one router does) and adopts it: it runs the response's request again, kept in the store when it
started (``keep_request``), from the prompt, for the tenant and priority class kept with it (a
request kept without them, or for a tenant this router does not configure, counts toward no tenant's
slots: router/cluster/tenancy.py ``UNATTRIBUTED``), and passes on only what the log does not have yet. The run
again is deterministic: greedy, or seeded (a background response asked without a seed gets one when it is
made), so its text starts with the logged text; ``Replay`` cuts that text into the pieces the log has, so
the events it makes are the logged ones, numbered alike, and the log goes on after its last event with no
gap and no event twice. A run again whose text leaves the logged text (a different engine, a batch that
changed a greedy choice) ends ``failed`` there, naming why; so does a response that cannot be run again
(its request not kept, tool calls parsed out of its text). A cancel of such a response ends it
``cancelled`` instead of adopting it. A router's events are written only while it holds the lease (checked
in the write's transaction: ``append_events(..., holder)``), so one that stalled past its lease, not dead,
writes nothing after the router that took it, and stops at its next write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from router.api.response_store import ResponseStore, StoredResponse
from router.api.response_store.base import Event, KeptCaller, LeaseLost
from router.errors import OpenAIError

log = logging.getLogger(__name__)

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})
POLL_S = 0.1  # a stream whose response runs on another router looks for new events this often
CANCEL_POLL_S = 0.25  # a running response asks the store whether a cancel came at least this often
LEASE_S = 5.0  # a running response's lease lasts this long past each renewal: a router silent longer is gone
RENEW_S = 1.0  # how often the router running a response renews its lease (and others look for expired ones)
SWEEP_S = 2.0  # how often a router looks for responses whose router is gone, that nobody reads
SWEEP_BATCH = 16  # responses a sweep takes at most
EVENTS_PER_READ = 256
MAX_SEQ = 2**31 - 1  # a sequence number fits both databases' INTEGER

StopReason = Literal["cancelled", "shutdown", "event_log_full", "store_failed", "lease_lost"]
# Opens a response's sessions and gives its stream of events (router/api/responses.py).
Begin = Callable[["Run"], Awaitable[AsyncGenerator[str, None]]]
# A row for a status: (status, output so far, error or None) -> the row to store.
RowFor = Callable[[str, list[dict[str, Any]], dict[str, Any] | None], StoredResponse]
# How this router carries on a response another router ran: (its row, its logged events) -> how to run it
# again, or None when it cannot be (it then ends failed) (router/api/responses.py).
CarryOn = Callable[[StoredResponse, list[Event]], Awaitable[tuple[Begin, RowFor] | None]]


@dataclass(frozen=True)
class EventLimits:
    """How much of a background response's event log is kept (``router.response_store``)."""

    max_events: int = 65_536
    max_bytes: int = 64 << 20


def event_type(sse: str) -> str:
    """The type of one stored event (``event: <type>\\ndata: <json>\\n\\n``)."""
    return sse.split("\n", 1)[0].removeprefix("event: ")


def sse_data(sse: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(sse.split("\ndata: ", 1)[1])
    return data


def sse_of(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class Diverged(OpenAIError):
    """A response run again gave another text than the one its log already has."""

    def __init__(self, why: str) -> None:
        message = f"the response, carried on by another router, diverged from its logged text: {why}"
        super().__init__(500, message, code="server_error")


class Replay:
    """The text a response's log already has, in the pieces it was logged in. The same generation run
    again gives its text through ``feed``: first in exactly those pieces (each checked), then as it comes,
    so that the events made from it are the logged ones, numbered alike, and then the new ones."""

    def __init__(self, pieces: list[str]) -> None:
        self._pieces = deque(piece for piece in pieces if piece)
        self._held = ""

    def feed(self, text: str) -> list[str]:
        """The pieces ``text`` completes (the logged ones first); raises ``Diverged``."""
        self._held += text
        pieces: list[str] = []
        while self._pieces:
            want = self._pieces[0]
            if len(self._held) < len(want):
                if not want.startswith(self._held):
                    raise Diverged(f"{self._held!r} where the log has {want!r}")
                return pieces
            if not self._held.startswith(want):
                raise Diverged(f"{self._held[: len(want)]!r} where the log has {want!r}")
            pieces.append(want)
            self._held = self._held[len(want) :]
            self._pieces.popleft()
        if self._held:
            pieces.append(self._held)
            self._held = ""
        return pieces

    def end(self) -> None:
        """The generation ended: raises ``Diverged`` if it gave less text than the log has."""
        if self._pieces:
            raise Diverged(f"it ended {sum(map(len, self._pieces)) - len(self._held)} characters short of it")

    @staticmethod
    def of(logged: list[Event]) -> Replay:
        """The logged text's pieces: its ``response.output_text.delta`` events'."""
        return Replay([sse_data(sse)["delta"] for _, sse in logged if event_type(sse) == "response.output_text.delta"])


class OutputSoFar:
    """The output items a response's events describe so far: a cancelled or failed response's output."""

    def __init__(self) -> None:
        self._done: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def feed(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "response.output_item.added":
            self._open = dict(event["item"])
            if self._open["type"] == "message":
                self._open["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        elif kind == "response.output_item.done":
            self._done.append(event["item"])
            self._open = None
        elif kind == "response.output_text.delta" and self._open is not None:
            self._open["content"][0]["text"] += event["delta"]
        elif kind == "response.function_call_arguments.delta" and self._open is not None:
            self._open["arguments"] += event["delta"]

    def items(self) -> list[dict[str, Any]]:
        """The finished items, then the open one (``incomplete``)."""
        return self._done + ([] if self._open is None else [{**self._open, "status": "incomplete"}])


class Run:
    """One background response running on this router: its task, the writes waiting for its writer, and
    what wakes this router's readers when a write lands."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.task: asyncio.Task[None] | None = None
        self.stop_reason: StopReason | None = None
        self.closing = False  # the generation is over: the writer ends once it has written everything
        self.final: StoredResponse | None = None  # the ending row, once queued
        self.done = asyncio.Event()
        self._ops: list[Event | StoredResponse] = []
        self._more = asyncio.Event()
        self._wrote = asyncio.Event()

    def add(self, op: Event | StoredResponse) -> None:
        """A write, after every one added before it."""
        if isinstance(op, StoredResponse) and op.response["status"] in ENDED:
            self.final = op
        self._ops.append(op)
        self._more.set()

    def take(self) -> list[Event | StoredResponse]:
        ops, self._ops = self._ops, []
        self._more.clear()
        return ops

    @property
    def pending(self) -> bool:
        return bool(self._ops)

    def close(self) -> None:
        """The generation is over: the writer ends once it has written everything."""
        self.closing = True
        self._more.set()

    async def more(self, timeout: float) -> None:
        """Until a write is added (or ``timeout``)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._more.wait(), timeout)

    def wrote(self) -> None:
        """A write landed: wakes the readers waiting on ``changed``."""
        landed, self._wrote = self._wrote, asyncio.Event()
        landed.set()

    @property
    def changed(self) -> asyncio.Event:
        """Set when the next write lands."""
        return self._wrote

    def stop(self, reason: StopReason) -> None:
        """Stops the generation (its ``finally`` closes the sessions), unless it is over already."""
        if self.stop_reason is None and not self.closing and self.task is not None:
            self.stop_reason = reason
            self.task.cancel()


class BackgroundRuns:
    """The background responses this router runs, and the reads, streams and cancels of any."""

    def __init__(self, store: ResponseStore, limits: EventLimits) -> None:
        self.store = store
        self.limits = limits
        self.runs: dict[str, Run] = {}
        self.holder = f"router-{secrets.token_hex(8)}"  # this router, in the leases of what it runs
        self.carry_on: CarryOn | None = None  # how to run again a response adopted from a router gone
        # A running response's conversation (history, then its input) with its output: the ending row's.
        self.with_output: Callable[[list[dict[str, Any]], list[dict[str, Any]]], list[dict[str, Any]]] = (
            lambda conversation, output: conversation
        )
        self.adopted = 0  # responses this router took over and carried on
        self.on_adopted: Callable[[], None] = lambda: None  # each adoption, told (the router's metric)

    async def start(
        self, queued: StoredResponse, begin: Begin, row: RowFor, request: str, caller: KeptCaller | None = None
    ) -> Run:
        """Stores the response ``queued`` and its ``request`` (JSON: what another router runs again if this
        one dies) with its ``caller`` (whom that router runs it for), takes its lease and runs it:
        ``begin(run)`` opens its sessions and gives its stream of events; ``row`` builds its row for a status."""
        await asyncio.to_thread(self.store.keep_request, queued.id, request, caller)
        await asyncio.to_thread(self.store.put, queued)
        await asyncio.to_thread(self.store.renew_lease, queued.id, self.holder, time.time() + LEASE_S)
        return self._launch(queued.id, begin, row, [])

    def _launch(self, response_id: str, begin: Begin, row: RowFor, logged: list[Event]) -> Run:
        run = Run(response_id)
        self.runs[response_id] = run
        run.task = asyncio.create_task(self._run(run, begin, row, logged), name=f"background {response_id}")
        return run

    async def shutdown(self) -> None:
        """The router stops: its responses end ``failed``, their rows and events written."""
        runs = list(self.runs.values())
        for run in runs:
            run.stop("shutdown")
        await asyncio.gather(*(run.done.wait() for run in runs))

    async def _run(self, run: Run, begin: Begin, row: RowFor, logged: list[Event]) -> None:
        """``logged``: the events a router gone kept (an adopted response): the stream gives them again
        first, and only what follows them is added."""
        writer = asyncio.create_task(self._write(run))
        output = OutputSoFar()
        failure: dict[str, Any] | None = None
        seq, size, last_kind = logged[-1][0] if logged else -1, 0, ""
        for _, sse in logged:
            size, last_kind = size + len(sse), event_type(sse)
            output.feed(sse_data(sse))
        kinds = {n: event_type(sse) for n, sse in logged}
        after = seq
        try:
            stream = await begin(run)
            run.add(row("in_progress", [], None))
            async with contextlib.aclosing(stream):
                async for sse in stream:
                    kind = event_type(sse)
                    if kind not in TERMINAL_EVENTS and (
                        seq + 3 > self.limits.max_events or size + len(sse) > self.limits.max_bytes
                    ):  # this one, and room left for the closing one
                        run.stop_reason = "event_log_full"
                        break  # closing the stream closes its sessions
                    event = sse_data(sse)
                    if event["sequence_number"] <= after:  # logged already (an adopted response's)
                        if kind != "error" and kind not in TERMINAL_EVENTS:
                            logged_kind = kinds.get(event["sequence_number"])
                            if logged_kind != kind:
                                raise Diverged(f"a {kind} event where the log has a {logged_kind}")
                            continue
                        event = {**event, "sequence_number": after + 1}
                        sse = sse_of(event)
                    seq, size, last_kind = event["sequence_number"], size + len(sse), kind
                    run.add((seq, sse))
                    output.feed(event)
                    if kind == "error":
                        failure = {"code": event.get("code") or "server_error", "message": event["message"]}
        except asyncio.CancelledError:
            if run.stop_reason is None:  # not asked for by ``stop`` (the event loop closing): passed on
                writer.cancel()
                self.runs.pop(run.response_id, None)
                run.done.set()
                raise
        except OpenAIError as exc:  # no session opened: no server, or no slot in time
            failure = {"code": exc.code or str(exc.status), "message": exc.message}
        self._end(run, row, output, failure, seq, last_kind)
        run.close()
        await writer
        run.done.set()
        self.runs.pop(run.response_id, None)

    def _end(
        self, run: Run, row: RowFor, output: OutputSoFar, failure: dict[str, Any] | None, seq: int, last_kind: str
    ) -> None:
        """The ending writes: the row for how it ended, and the log's closing event (none when cancelled)."""
        final = run.final
        if run.stop_reason == "lease_lost":  # another router found this one gone and ended it
            return
        if final is not None and failure is None:  # it completed (maybe while being cancelled)
            if last_kind not in TERMINAL_EVENTS:  # stopped between its row and its closing event
                event = {"type": "response.completed", "sequence_number": seq + 1, "response": final.response}
                run.add((seq + 1, sse_of(event)))
            return
        if run.stop_reason == "cancelled" and failure is None:
            run.add(row("cancelled", output.items(), None))
            return
        if failure is None:
            failure = {
                "code": "server_error",
                "message": {
                    "shutdown": "the router stopped",
                    "event_log_full": f"the response's events passed router.response_store's limits "
                    f"({self.limits.max_events} events, {self.limits.max_bytes} bytes)",
                    "store_failed": "the response store failed",
                }.get(run.stop_reason or "", "the response ended without an answer"),
            }
        failed = row("failed", output.items(), failure)
        run.add(failed)
        event = {"type": "response.failed", "sequence_number": seq + 1, "response": failed.response}
        run.add((seq + 1, sse_of(event)))

    async def _write(self, run: Run) -> None:
        """Writes the run's rows and events in order, each batch in one call; learns of cancels asked
        through the store. The ending row goes last, after the closing event queued just after it: a
        reader that finds the row ended finds every event already there."""
        renewed = time.monotonic()
        try:
            while True:
                if time.monotonic() - renewed >= RENEW_S:
                    renewed = time.monotonic()
                    held = await asyncio.to_thread(
                        self.store.renew_lease, run.response_id, self.holder, time.time() + LEASE_S
                    )
                    if not held:
                        log.warning("background response %s: its lease was taken; it stops here", run.response_id)
                        run.stop("lease_lost")
                        run.take()  # its rows and events are another router's to write now
                events: list[Event] = []
                cancel, ending = False, None
                for op in run.take():
                    if isinstance(op, StoredResponse) and op.response["status"] in ENDED:
                        ending = op
                    elif isinstance(op, StoredResponse):
                        if events:
                            cancel |= await asyncio.to_thread(
                                self.store.append_events, run.response_id, events, self.holder
                            )
                            events = []
                        await asyncio.to_thread(self.store.put, op)
                    else:
                        events.append(op)
                cancel |= await asyncio.to_thread(self.store.append_events, run.response_id, events, self.holder)
                if ending is not None and await asyncio.to_thread(
                    self.store.renew_lease, run.response_id, self.holder, time.time() + LEASE_S
                ):  # not taken meanwhile by a router that found this one gone (and ended it)
                    await asyncio.to_thread(self.store.put, ending)
                    await asyncio.to_thread(self.store.end_lease, run.response_id)
                run.wrote()
                if cancel:
                    run.stop("cancelled")
                if run.closing and not run.pending:
                    return
                await run.more(CANCEL_POLL_S)
        except LeaseLost:
            log.warning("background response %s: its lease was taken; it stops here", run.response_id)
            run.stop("lease_lost")
            run.take()
            run.wrote()
        except Exception:
            log.exception("background response %s: the store failed; the response stops", run.response_id)
            run.stop("store_failed")
            run.wrote()

    # ---- any router: reading, streaming, cancelling ----------------------------------------------------

    async def get(self, response_id: str, owner: str) -> StoredResponse:
        stored = await asyncio.to_thread(self.store.get, response_id, owner)
        if stored is None:
            raise OpenAIError(404, f"no stored response with id {response_id!r}", param="response_id", code="not_found")
        return stored

    async def poll(self, response_id: str, owner: str) -> StoredResponse:
        """The response as it stands; one whose router is gone (its lease expired) is adopted first (or,
        when it cannot be carried on, ends ``failed``)."""
        stored = await self.get(response_id, owner)
        if await self._take_orphan(stored, "failed"):
            stored = await self.get(response_id, owner)
        return stored

    async def _take_orphan(self, stored: StoredResponse, status: Literal["failed", "cancelled"]) -> bool:
        """Takes a background response whose router is gone, if this router is the one that takes its
        expired lease: carries it on (``status`` failed: what it comes to when it cannot be) or ends it."""
        if not stored.response.get("background") or stored.response["status"] in ENDED or stored.id in self.runs:
            return False
        now = time.time()
        if not await asyncio.to_thread(self.store.take_lease, stored.id, self.holder, now + LEASE_S, now):
            return False
        logged = await asyncio.to_thread(self.store.events_after, stored.id, -1, 1 << 30)
        if status == "failed" and not (logged and event_type(logged[-1][1]) in TERMINAL_EVENTS):
            how = None
            if self.carry_on is not None:
                try:
                    how = await self.carry_on(stored, logged)
                except Exception:  # whatever it is, the response ends failed rather than hanging
                    log.exception("background response %s: it cannot be carried on", stored.id)
            if how is not None:
                log.warning(
                    "background response %s: its router is gone; carried on here after event %d",
                    stored.id,
                    logged[-1][0] if logged else -1,
                )
                self.adopted += 1
                self.on_adopted()
                self._launch(stored.id, *how, logged)
                return True
        await self._end_orphan(stored, status, logged)
        return True

    async def _end_orphan(
        self, stored: StoredResponse, status: Literal["failed", "cancelled"], logged: list[Event]
    ) -> None:
        """Ends a background response whose router is gone (its lease now this router's): the closing
        event (when failed and the log has none yet), then the row."""
        if logged and event_type(logged[-1][1]) in TERMINAL_EVENTS:  # the router died between the two
            response = sse_data(logged[-1][1])["response"]
            conversation = self.with_output(stored.conversation, response["output"])
            ended = StoredResponse(
                stored.id, stored.owner, stored.created_at, response, stored.input_items, conversation
            )
            await asyncio.to_thread(self.store.put, ended)
            await asyncio.to_thread(self.store.end_lease, stored.id)
            return
        output = OutputSoFar()
        for _, sse in logged:
            output.feed(sse_data(sse))
        items = output.items()
        error = None if status == "cancelled" else {"code": "server_error", "message": "the router running it stopped"}
        response = {**stored.response, "status": status, "output": items, "error": error}
        if status == "failed":
            seq = logged[-1][0] + 1 if logged else 0
            event = sse_of({"type": "response.failed", "sequence_number": seq, "response": response})
            await asyncio.to_thread(self.store.append_events, stored.id, [(seq, event)], self.holder)
        ended = StoredResponse(
            stored.id, stored.owner, stored.created_at, response, stored.input_items, stored.conversation
        )
        await asyncio.to_thread(self.store.put, ended)
        await asyncio.to_thread(self.store.end_lease, stored.id)

    async def sweep(self) -> None:
        """Every ``SWEEP_S``, ``sweep_once``: a response whose router died goes on even if nobody reads it."""
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep_once()
            except Exception:  # the store is down: the next sweep tries again
                log.exception("background responses: the sweep for responses whose router is gone failed")

    async def sweep_once(self) -> int:
        """Takes the responses whose lease lapsed (their router is gone), as their first read would; how
        many this router took."""
        taken = 0
        for response_id, owner in await asyncio.to_thread(self.store.lapsed_leases, time.time(), SWEEP_BATCH):
            stored = await asyncio.to_thread(self.store.get, response_id, owner)
            if stored is not None and stored.response["status"] in ENDED:  # ended before its lease did
                await asyncio.to_thread(self.store.end_lease, response_id)
            elif stored is not None:
                taken += await self._take_orphan(stored, "failed")
        return taken

    async def check_stream(self, stored: StoredResponse, starting_after: int | None) -> None:
        """400 unless ``stored`` is a background response with an event after ``starting_after``."""
        if not stored.response.get("background"):
            raise OpenAIError(
                400, "only a response created with background: true can be streamed again", param="stream"
            )
        if starting_after is None:
            return
        if not 0 <= starting_after <= MAX_SEQ:
            raise OpenAIError(
                400, f"starting_after must be between 0 and {MAX_SEQ}, got {starting_after}", param="starting_after"
            )
        if stored.response["status"] in ENDED:
            count = await asyncio.to_thread(self.store.event_count, stored.id)
            if starting_after > count - 1:
                raise OpenAIError(
                    400,
                    f"starting_after {starting_after} is beyond the response's last event ({count - 1})",
                    param="starting_after",
                )

    async def events(self, response_id: str, owner: str, starting_after: int | None) -> AsyncIterator[str]:
        """The response's events numbered above ``starting_after``: the stored ones, then the live ones
        until the last."""
        last = -1 if starting_after is None else starting_after
        looked = time.monotonic()
        while True:
            run = self.runs.get(response_id)
            changed = run.changed if run is not None else None  # taken before the read: no write missed
            batch = await asyncio.to_thread(self.store.events_after, response_id, last, EVENTS_PER_READ)
            for seq, sse in batch:
                yield sse
                last = seq
                if event_type(sse) in TERMINAL_EVENTS:
                    return
            if len(batch) == EVENTS_PER_READ:
                continue
            if not batch:
                stored = await asyncio.to_thread(self.store.get, response_id, owner)
                if stored is None:  # deleted meanwhile
                    return
                if stored.response["status"] in ENDED:  # its events were all written before its row
                    for _, sse in await asyncio.to_thread(self.store.events_after, response_id, last, 1 << 30):
                        yield sse
                    return
                if run is None and time.monotonic() - looked >= RENEW_S:  # is the router running it still there?
                    looked = time.monotonic()
                    if await self._take_orphan(stored, "failed"):
                        continue
            if changed is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), POLL_S)
            else:
                await asyncio.sleep(POLL_S)

    async def cancel(self, response_id: str, owner: str) -> dict[str, Any]:
        """Stops the response (here, or through the store on the router running it); its state then."""
        stored = await self.get(response_id, owner)
        if not stored.response.get("background"):
            raise OpenAIError(
                400, "only a response created with background: true can be cancelled", param="response_id"
            )
        if stored.response["status"] in ENDED:
            return stored.response
        run = self.runs.get(response_id)
        if run is not None:
            run.stop("cancelled")
            await run.done.wait()
            return (await self.get(response_id, owner)).response
        await asyncio.to_thread(self.store.request_cancel, response_id)
        while True:  # until the router running it stops it, or, gone, its lease expires and this one ends it
            if await self._take_orphan(stored, "cancelled"):
                return (await self.get(response_id, owner)).response
            stored = await self.get(response_id, owner)
            if stored.response["status"] in ENDED:
                return stored.response
            await asyncio.sleep(POLL_S)
