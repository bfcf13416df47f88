"""The router's HTTP calls to prefill and decode servers (router/cluster/h1_client.py).

Every way a call can fail is one ``WorkerFailed`` whose ``outcome`` says
why, in the servers' own vocabulary (``transfer.outcome.Outcome``): the code
of a server's ``ErrorReply`` or stream ``ErrorEvent`` as it was sent,
``UNREACHABLE`` when the connection was refused or reset, ``TIMED_OUT`` when
no answer came in time, and ``STREAM_CUT`` / ``WORKER_ERROR`` for answers the
router cannot use. Every answer is reported to ``answered`` (passive health,
router/cluster/health.py). A decode stream silent for ``stream_stall_s`` seconds is
``TIMED_OUT``: a live decode server sends a heartbeat (``AliveEvent``) every
``STREAM_HEARTBEAT_S`` when it has nothing else to send, so only a stopped
(frozen, paused, cut off) one is silent that long.

Connections are kept alive and reused (the pool is the ``H1Client``
router/app.py makes; its failures are httpx's exceptions): a decode stream is read to its end after its last
event, so its connection goes back to the pool; a prefill reply is always
read, even when the caller stops waiting for it (the request finished or was
aborted), so a cancelled call does not cost a connection. Only a stream
closed before its end (the client left) closes its connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from pydantic import ValidationError

from router.cluster.h1_client import H1Client, Reply
from router.cluster.registry import Worker
from router.settings import RouterSettings
from transfer.outcome import KV_NEVER_ARRIVED, Outcome
from wire.names import ROLE_EPOCH_HEADER
from wire.replies import (
    DECODE_EVENT,
    AliveEvent,
    ErrorEvent,
    ErrorReply,
    PrefillResult,
    ReprefillEvent,
    Reservation,
    ReservationEvent,
    TokensEvent,
)
from wire.requests import AbortRequest, GenerateRequest, PrefillRequest

log = logging.getLogger(__name__)


class WorkerFailed(Exception):
    """A step on one worker failed. ``role`` is the worker's role ("prefill" or
    "decode"; ``worker`` may be empty when no worker of that role was left);
    ``never_reached``: the request cannot have reached the worker, so another
    one may take it; ``retry_after``: the worker's Retry-After, if it sent one."""

    def __init__(
        self,
        role: str,
        worker: str,
        reason: str,
        outcome: Outcome,
        *,
        never_reached: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{role} server {worker} failed: {reason}" if worker else reason)
        self.role, self.worker, self.reason, self.outcome = role, worker, reason, outcome
        self.never_reached, self.retry_after = never_reached, retry_after

    @classmethod
    def of(
        cls,
        worker: Worker,
        reason: str,
        outcome: Outcome,
        *,
        never_reached: bool = False,
        retry_after: float | None = None,
    ) -> WorkerFailed:
        return cls(worker.role, worker.name, reason, outcome, never_reached=never_reached, retry_after=retry_after)

    @property
    def stage(self) -> str:
        """What failed: "prefill" also when the decode server reports that the KV never arrived."""
        return "prefill" if self.role == "prefill" or self.outcome in KV_NEVER_ARRIVED else "decode"


# Failures before the request was sent: another worker may take it.
BIG_LINE_BYTES = 1 << 16  # a decode event longer than this is parsed on a thread
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _unreachable(worker: Worker, exc: httpx.HTTPError, what: str = "") -> WorkerFailed:
    """No answer: ``TIMED_OUT`` when it did not come in time, else ``UNREACHABLE`` (refused, reset)."""
    if isinstance(exc, httpx.TimeoutException):
        return WorkerFailed.of(
            worker, f"timed out: {what}{exc!r}", Outcome.TIMED_OUT, never_reached=isinstance(exc, NOT_SENT)
        )
    return WorkerFailed.of(
        worker, f"unreachable: {what}{exc!r}", Outcome.UNREACHABLE, never_reached=isinstance(exc, NOT_SENT)
    )


# A server that switched role (deploy/role_server.py) refused the call before it touched anything.
ROLE_REFUSALS = frozenset({Outcome.WRONG_ROLE, Outcome.STALE_EPOCH})


def _role_headers(worker: Worker) -> dict[str, str]:
    """The JSON content type, and the role epoch this router last saw the worker in (when it reports one):
    a worker in another epoch refuses the call (409 ``stale_epoch``) instead of serving it in a new role."""
    headers = {"content-type": "application/json"}
    if worker.role_epoch is not None:
        headers[ROLE_EPOCH_HEADER] = str(worker.role_epoch)
    return headers


def _ignore(worker: Worker) -> None:
    pass


def _refusal(
    worker: Worker,
    resp: Reply,
    default: Outcome,
    *,
    never_reached: bool = False,
    retry_after: float | None = None,
) -> WorkerFailed:
    """The server's ErrorReply as a WorkerFailed (``default`` when the body is not one)."""
    try:
        reply = ErrorReply.model_validate_json(resp.content)
    except ValidationError:
        return WorkerFailed.of(
            worker,
            f"HTTP {resp.status_code}: {resp.text[:200]}",
            default,
            never_reached=never_reached,
            retry_after=retry_after,
        )
    return WorkerFailed.of(
        worker,
        f"HTTP {resp.status_code}: {reply.error}",
        reply.code,
        never_reached=never_reached or reply.code in ROLE_REFUSALS,
        retry_after=retry_after,
    )


async def ndjson_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of an NDJSON byte stream, without their newlines; a line cut across chunks comes
    whole, and a last line without a newline comes too. Bytes, as pydantic parses them: no text
    decoding and no line decoder per token (``aiter_lines`` stacks both on the same chunks)."""
    pending: list[bytes] = []  # a line's parts so far: a megabyte line in many chunks is joined once
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if pending:
                pending.append(chunk[start:end])
                yield b"".join(pending)
                pending.clear()
            else:
                yield chunk[start:end]
            start = end + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        yield b"".join(pending)


class DecodeStream:
    """One open ``/generate`` stream; ``reservation`` is its first event. ``request_id``: the attempt id
    it was opened under, which the decode server (and a prefill server filling its reservation) knows
    it by."""

    def __init__(
        self,
        worker: Worker,
        response: Reply,
        lines: AsyncIterator[bytes],
        answered: Callable[[Worker], None] = _ignore,
        sequences: int = 1,
        *,
        request_id: str = "",
    ) -> None:
        self.worker = worker
        self.request_id = request_id
        self.sequences = sequences  # the request's n: the stream ends after each one's last event
        self.reservation: Reservation | None = None
        self.num_cached_tokens = 0  # prompt tokens the decode server found in its prefix cache
        self._response = response
        self._lines = lines
        self._answered = answered

    async def read_reservation(self) -> None:
        event = await self._next_event()
        if isinstance(event, ErrorEvent):
            raise WorkerFailed.of(self.worker, event.message, event.code)
        if not isinstance(event, ReservationEvent):
            raise WorkerFailed.of(self.worker, f"expected a reservation first, got {event.type}", Outcome.WORKER_ERROR)
        self.reservation = event.reservation
        self.num_cached_tokens = event.num_cached_tokens

    async def events(self) -> AsyncIterator[TokensEvent | ReprefillEvent]:
        """Token events until every sequence's one with a finish_reason (a reprefill event
        may come before the first); raises on an error event or a cut stream."""
        unfinished = set(range(self.sequences))
        while True:
            event = await self._next_event()
            if isinstance(event, ErrorEvent):
                raise WorkerFailed.of(self.worker, event.message, event.code)
            if not isinstance(event, (TokensEvent, ReprefillEvent)):
                raise WorkerFailed.of(self.worker, f"unexpected {event.type} event", Outcome.WORKER_ERROR)
            if isinstance(event, TokensEvent) and event.finish_reason is not None:
                unfinished.discard(event.index)
            if not unfinished:
                await self._read_to_end()
                yield event
                return
            yield event

    async def _read_to_end(self) -> None:
        """After the last event the server ends the stream: read that end, so that the
        connection is idle and goes back to the pool when the response closes."""
        try:
            async for _ in self._lines:
                pass  # nothing follows the last event; a line here would only be ignored
        except httpx.HTTPError as exc:
            log.info("decode stream on %s broken after its last event: %r", self.worker.name, exc)

    async def _next_event(self) -> ReservationEvent | TokensEvent | ErrorEvent | ReprefillEvent:
        try:
            while True:
                line = await anext(self._lines)
                if not line.strip():
                    continue
                # A line of a prompt's log-probabilities can be megabytes: parsed off the event loop.
                event = (
                    DECODE_EVENT.validate_json(line)
                    if len(line) < BIG_LINE_BYTES
                    else await asyncio.to_thread(DECODE_EVENT.validate_json, line)
                )
                self._answered(self.worker)
                if not isinstance(event, AliveEvent):
                    return event
        except StopAsyncIteration:
            raise WorkerFailed.of(self.worker, "stream ended early", Outcome.STREAM_CUT) from None
        except httpx.HTTPError as exc:
            raise _unreachable(self.worker, exc, "stream broken: ") from exc
        except ValidationError as exc:
            raise WorkerFailed.of(self.worker, f"bad event: {exc}", Outcome.WORKER_ERROR) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class WorkerClient:
    """``answered(worker)`` is called on every answer from a worker (router/cluster/health.py)."""

    def __init__(
        self,
        http: H1Client,
        *,
        prefill_timeout_s: float,
        answered: Callable[[Worker], None] = _ignore,
        stream_stall_s: float = RouterSettings.stream_stall_s,
    ) -> None:
        self._http = http
        self._prefill_timeout_s = prefill_timeout_s
        # A decode stream (its answer's start included) silent this long: the server stopped. A live
        # one sends a heartbeat every STREAM_HEARTBEAT_S when it has nothing else to send.
        self._stream_stall_s = stream_stall_s
        self._answered = answered
        self._prefills: set[asyncio.Task] = set()  # calls still reading a reply nobody waits for

    async def open_decode(self, worker: Worker, req: GenerateRequest) -> DecodeStream:
        """Start ``/generate``; returns once the reservation (first event) is in."""
        try:
            response = await self._http.request(
                "POST",
                f"{worker.url}/generate",
                req.model_dump_json(),
                _role_headers(worker),
                timeout=10.0,
                read_timeout=self._stream_stall_s,
                stream=True,
            )
        except httpx.HTTPError as exc:
            raise _unreachable(worker, exc) from exc
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            if response.status_code == 503:  # no room, draining, engine down: try another, or later
                raise _refusal(
                    worker,
                    response,
                    Outcome.NO_ROOM,
                    never_reached=True,
                    retry_after=float(response.headers.get("retry-after", "1")),
                )
            raise _refusal(worker, response, Outcome.WORKER_ERROR)
        lines = ndjson_lines(response.aiter_bytes())
        stream = DecodeStream(worker, response, lines, self._answered, req.sampling.n, request_id=req.request_id)
        try:
            await stream.read_reservation()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def prefill(self, worker: Worker, req: PrefillRequest) -> PrefillResult:
        """The prefill server's reply. Cancelling this leaves the call running until its
        reply is read (the server answers an aborted request at once), so its connection
        is reused rather than closed halfway through a reply."""
        call = asyncio.ensure_future(self._prefill(worker, req))
        self._prefills.add(call)
        call.add_done_callback(self._prefill_done)
        return await asyncio.shield(call)

    def _prefill_done(self, call: asyncio.Task) -> None:
        self._prefills.discard(call)
        if not call.cancelled():
            call.exception()  # retrieved: a reply nobody waited for any more is not an error to log

    async def _prefill(self, worker: Worker, req: PrefillRequest) -> PrefillResult:
        try:
            resp = await self._http.request(
                "POST",
                f"{worker.url}/prefill",
                req.model_dump_json(),
                _role_headers(worker),
                timeout=self._prefill_timeout_s,
            )
        except httpx.HTTPError as exc:
            raise _unreachable(worker, exc) from exc
        if resp.status_code == 503:  # draining or engine down: it did not take the request, another one may
            raise _refusal(worker, resp, Outcome.ENGINE_DOWN, never_reached=True)
        if resp.status_code != 200:
            raise _refusal(worker, resp, Outcome.WORKER_ERROR)
        self._answered(worker)
        try:
            return PrefillResult.model_validate_json(resp.content)
        except ValidationError as exc:
            raise WorkerFailed.of(worker, f"bad reply: {exc}", Outcome.WORKER_ERROR) from exc

    async def abort(self, worker: Worker, request_id: str) -> None:
        """Best effort: the worker may already be gone or done with it."""
        try:
            await self._http.request(
                "POST",
                f"{worker.url}/abort",
                AbortRequest(request_id=request_id).model_dump_json(),
                {"content-type": "application/json"},
                timeout=2.0,
            )
        except httpx.HTTPError as exc:
            log.info("abort %s on %s failed: %r", request_id, worker.name, exc)
