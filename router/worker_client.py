"""The router's HTTP calls to prefill and decode servers (httpx).

Three outcomes the dispatcher tells apart: ``NoRoom`` (a decode server
refused a reservation at once: try another one or wait), ``WorkerUnreachable``
(connection refused/reset: take the worker out of rotation) and
``WorkerFailed`` (the worker answered, but with an error).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from pydantic import ValidationError

from router.registry import Worker
from server_common.worker_replies import (
    DECODE_EVENT,
    ErrorEvent,
    PrefillResult,
    ReprefillEvent,
    Reservation,
    ReservationEvent,
    TokensEvent,
)
from server_common.worker_requests import AbortRequest, GenerateRequest, PrefillRequest

log = logging.getLogger(__name__)


class NoRoom(Exception):
    def __init__(self, worker: Worker, retry_after: float) -> None:
        super().__init__(f"{worker.name} has no free KV blocks")
        self.retry_after = retry_after


class WorkerUnreachable(Exception):
    """``never_connected``: the request cannot have reached the worker, so another one may take it."""

    def __init__(self, worker: Worker, reason: str, never_connected: bool = False) -> None:
        super().__init__(f"{worker.role} server {worker.name} unreachable: {reason}")
        self.worker = worker
        self.never_connected = never_connected


class WorkerFailed(Exception):
    def __init__(self, worker: Worker, reason: str, code: str = "worker_error") -> None:
        super().__init__(f"{worker.role} server {worker.name} failed: {reason}")
        self.worker = worker
        self.code = code


def _reason(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        return str(body.get("error") or body.get("detail") or body)
    except ValueError:
        return resp.text[:200] or f"HTTP {resp.status_code}"


def _code(resp: httpx.Response) -> str:
    """The ``code`` of a server's RefusedReply ("worker_error" when there is none)."""
    try:
        code = resp.json().get("code")
    except (ValueError, AttributeError):
        return "worker_error"
    return code if isinstance(code, str) and code else "worker_error"


class DecodeStream:
    """One open ``/generate`` stream; ``reservation`` is its first event."""

    def __init__(self, worker: Worker, response: httpx.Response, lines: AsyncIterator[str]) -> None:
        self.worker = worker
        self.reservation: Reservation | None = None
        self._response = response
        self._lines = lines

    async def read_reservation(self) -> None:
        event = await self._next_event()
        if isinstance(event, ErrorEvent):
            raise WorkerFailed(self.worker, event.message, event.code)
        if not isinstance(event, ReservationEvent):
            raise WorkerFailed(self.worker, f"expected a reservation first, got {event.type}")
        self.reservation = event.reservation

    async def events(self) -> AsyncIterator[TokensEvent | ReprefillEvent]:
        """Token events until the one with a finish_reason (a reprefill event may come
        before the first); raises on an error event or a cut stream."""
        while True:
            event = await self._next_event()
            if isinstance(event, ErrorEvent):
                raise WorkerFailed(self.worker, event.message, event.code)
            if not isinstance(event, (TokensEvent, ReprefillEvent)):
                raise WorkerFailed(self.worker, f"unexpected {event.type} event")
            yield event
            if isinstance(event, TokensEvent) and event.finish_reason is not None:
                return

    async def _next_event(self):
        try:
            line = ""
            while not line.strip():
                line = await anext(self._lines)
            return DECODE_EVENT.validate_json(line)
        except StopAsyncIteration:
            raise WorkerFailed(self.worker, "stream ended early", "stream_cut") from None
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(self.worker, f"stream broken: {exc!r}") from exc
        except ValidationError as exc:
            raise WorkerFailed(self.worker, f"bad event: {exc}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class WorkerClient:
    def __init__(self, http: httpx.AsyncClient, *, prefill_timeout: float) -> None:
        self._http = http
        self._prefill_timeout = prefill_timeout

    async def open_decode(self, worker: Worker, req: GenerateRequest) -> DecodeStream:
        """Start ``/generate``; returns once the reservation (first event) is in."""
        request = self._http.build_request(
            "POST", f"{worker.url}/generate", content=req.model_dump_json(),
            headers={"content-type": "application/json"}, timeout=httpx.Timeout(10.0, read=None),
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(worker, repr(exc)) from exc
        if response.status_code == 503:
            retry_after = float(response.headers.get("retry-after", "1"))
            await response.aread()
            await response.aclose()
            raise NoRoom(worker, retry_after)
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            raise WorkerFailed(worker, f"HTTP {response.status_code}: {_reason(response)}")
        stream = DecodeStream(worker, response, response.aiter_lines())
        try:
            await stream.read_reservation()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def prefill(self, worker: Worker, req: PrefillRequest) -> PrefillResult:
        try:
            resp = await self._http.post(
                f"{worker.url}/prefill", content=req.model_dump_json(),
                headers={"content-type": "application/json"}, timeout=self._prefill_timeout,
            )
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(worker, repr(exc), isinstance(exc, httpx.ConnectError)) from exc
        if resp.status_code == 503:  # draining or engine down: it did not take the request, another one may
            raise WorkerUnreachable(worker, f"refused: {_reason(resp)}", never_connected=True)
        if resp.status_code != 200:
            raise WorkerFailed(worker, f"HTTP {resp.status_code}: {_reason(resp)}", _code(resp))
        return PrefillResult.model_validate_json(resp.content)

    async def abort(self, worker: Worker, request_id: str) -> None:
        """Best effort: the worker may already be gone or done with it."""
        try:
            await self._http.post(
                f"{worker.url}/abort", content=AbortRequest(request_id=request_id).model_dump_json(),
                headers={"content-type": "application/json"}, timeout=2.0,
            )
        except httpx.HTTPError as exc:
            log.info("abort %s on %s failed: %r", request_id, worker.name, exc)
