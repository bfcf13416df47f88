"""Slow and greedy clients: header and body timeouts, open connections per client.

uvicorn closes idle keep-alive connections but waits forever for a request
that arrives a byte at a time, so a few dozen slow clients could hold a
server's connections indefinitely. ``ConnectionGuard`` gives uvicorn's h11
protocol (``protocol_class``) three limits, on the router (config
``router:``) and on every prefill and decode server (config ``security:``,
``server_*``):

* ``header_timeout_s``: from a connection's start (or the end of the previous
  response on it) until the request's headers are complete;
* ``body_timeout_s``: from the headers until the whole body has arrived;
* ``max_connections_per_client``: open connections from one address; one more
  is answered 503 (and ``Connection: close``) at once, without reading it.

A connection that passes a limit is closed and counted in
``pdserve_router_connections_refused{reason="header_timeout|body_timeout|too_many"}``
(``pdserve_connections_refused`` on the servers).
A response being streamed is never cut: the timers stop once the request has
been read.
"""

from __future__ import annotations

import asyncio

import h11
from prometheus_client.core import CounterMetricFamily
from uvicorn.protocols.http.h11_impl import H11Protocol

REASONS = ("header_timeout", "body_timeout", "too_many")
# What a connection over the per-client cap gets before it is closed: in OpenAI's error shape, which
# the servers' ErrorReply readers take as well.
_TOO_MANY_BODY = (b'{"error":{"message":"too many open connections from this address; close some and retry",'
                  b'"type":"server_error","param":null,"code":"too_many_connections"}}')
TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(_TOO_MANY_BODY)).encode() + b"\r\n\r\n"
            + _TOO_MANY_BODY)


class ConnectionGuard:
    """Owns the per-client connection counts and the refusal counters (event loop only)."""

    def __init__(self, header_timeout_s: float, body_timeout_s: float, max_per_client: int,
                 metric: str = "pdserve_router_connections_refused", who: str = "the router") -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_per_client = max_per_client
        self.metric, self.who = metric, who
        self.open: dict[str, int] = {}
        self.refused = dict.fromkeys(REASONS, 0)

    def claim(self, client: str) -> bool:
        if self.open.get(client, 0) >= self.max_per_client:
            self.refused["too_many"] += 1
            return False
        self.open[client] = self.open.get(client, 0) + 1
        return True

    def release(self, client: str) -> None:
        left = self.open.get(client, 0) - 1
        if left > 0:
            self.open[client] = left
        else:
            self.open.pop(client, None)

    def collect(self):
        family = CounterMetricFamily(self.metric, f"Client connections closed by {self.who}'s limits",
                                     labels=["reason"])
        for reason in REASONS:
            family.add_metric([reason], self.refused[reason])
        yield family

    def protocol_class(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol with this guard's limits (pass as ``uvicorn.Config(http=...)``)."""
        return type("GuardedH11Protocol", (_GuardedH11,), {"guard": self})


def server_guard(settings) -> ConnectionGuard:
    """A prefill or decode server's guard, from its ``ServerSettings``."""
    return ConnectionGuard(settings.header_timeout_s, settings.body_timeout_s, settings.max_connections_per_client,
                           metric="pdserve_connections_refused", who="the server")


class _GuardedH11(H11Protocol):
    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._claimed: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        client = self.client[0] if self.client else ""
        if not self.guard.claim(client):
            transport.write(TOO_MANY)
            transport.close()  # after the write is flushed
            return
        self._claimed = client
        self._arm("header_timeout", self.guard.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._claimed is not None:
            self.guard.release(self._claimed)
            self._claimed = None
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Header timer while no request arrived, body timer while it is being read, none after."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._phase != "header_timeout":
                self._arm("header_timeout", self.guard.header_timeout_s)
        elif state is h11.SEND_BODY:
            if self._phase != "body_timeout":
                self._arm("body_timeout", self.guard.body_timeout_s)
        else:
            self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if getattr(self, "_timer", None) is not None:
            self._timer.cancel()
        self._timer, self._phase = None, ""

    def _expired(self) -> None:
        self.guard.refused[self._phase] += 1
        self._timer, self._phase = None, ""
        if not self.transport.is_closing():
            self.transport.close()
