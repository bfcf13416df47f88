"""Slow and greedy clients: header and body timeouts, open connections per client.

uvicorn closes idle keep-alive connections but waits forever for a request
that arrives a byte at a time, so a few dozen slow clients could hold a
server's connections indefinitely. ``ConnectionGuard`` gives uvicorn's h11
protocol (``protocol_class``) three limits, on the router (config
``router:``) and on every prefill and decode server (config ``security:``,
``server_*``):

* ``header_timeout_s``: from a connection's start (or, on a kept-alive
  connection, the first byte of its next request) until the request's
  headers are complete; an idle kept-alive connection is uvicorn's to close,
  after its ``timeout_keep_alive`` (``serve(keep_alive_s=...)``: on the
  router, ``router.client_keepalive_s``, longer than clients keep theirs);
* ``body_timeout_s``: from the headers until the whole body has arrived;
* ``max_connections_per_client``: open connections from one address; one more
  is answered 503 (and ``Connection: close``) at once, without reading it;
* ``max_connections``: open connections in all, of which the last
  ``reserved_connections`` are kept for trusted addresses (loopback, and on a
  prefill or decode server the hosts of its cluster: the router's health
  checks and requests, the other servers' handshakes), so that thousands of
  strangers' connections cannot keep the router from reaching a server. The
  cap is also kept under the process's file-descriptor limit (raised to its
  hard limit at start), which a flood would otherwise exhaust, refusing
  everyone.

A connection that passes a limit is closed and counted in
``pdserve_router_connections_refused{reason="header_timeout|body_timeout|too_many|full"}``
(``pdserve_connections_refused`` on the servers); the connections open now are
``pdserve_router_connections_open`` (``pdserve_connections_open``).
A response being streamed is never cut: the timers stop once the request has
been read.
"""

from __future__ import annotations

import asyncio
import resource
import socket
from collections.abc import Iterable

import h11
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from uvicorn.protocols.http.h11_impl import H11Protocol

REASONS = ("header_timeout", "body_timeout", "too_many", "full")
LOOPBACK = frozenset({"127.0.0.1", "::1"})
FD_HEADROOM = 256  # descriptors kept for everything but client connections (model files, peers, pipes)


def _refusal(message: str) -> bytes:
    """What a connection over a cap gets before it is closed: in OpenAI's error shape, which the
    servers' ErrorReply readers take as well."""
    body = (
        b'{"error":{"message":"' + message.encode() + b'","type":"server_error","param":null,'
        b'"code":"too_many_connections"}}'
    )
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


TOO_MANY = _refusal("too many open connections from this address; close some and retry")
FULL = _refusal("the server has too many open connections; retry shortly")


def usable_connections(wanted: int) -> int:
    """``wanted``, or fewer when the file-descriptor limit (raised to its hard limit first) leaves less room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - FD_HEADROOM))


def addresses_of(hosts: Iterable[str]) -> frozenset[str]:
    """Every address the given hosts (names or addresses) resolve to now; names that do not resolve are skipped."""
    found: set[str] = set()
    for host in hosts:
        try:
            found.update(info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except (socket.gaierror, UnicodeError):
            continue
    return frozenset(found)


class ConnectionGuard:
    """Owns the connection counts and the refusal counters (event loop only). ``trusted``: addresses
    (or host names, resolved now) that may use the ``reserved`` connections; loopback always may."""

    def __init__(
        self,
        header_timeout_s: float,
        body_timeout_s: float,
        max_per_client: int,
        max_connections: int = 8192,
        reserved: int = 64,
        trusted: Iterable[str] = (),
        metric: str = "pdserve_router_connections_refused",
        who: str = "the router",
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_per_client = max_per_client
        self.max_connections = usable_connections(max_connections)
        self.reserved = min(reserved, self.max_connections - 1)
        self.trusted = LOOPBACK | addresses_of(trusted)
        self.metric, self.who = metric, who
        self.open: dict[str, int] = {}
        self.total = 0
        self.refused = dict.fromkeys(REASONS, 0)

    def claim(self, client: str) -> bytes | None:
        """None when ``client`` may open one more connection; else the answer that refuses it."""
        room = self.max_connections - (0 if client in self.trusted else self.reserved)
        if self.total >= room:
            self.refused["full"] += 1
            return FULL
        if self.open.get(client, 0) >= self.max_per_client:
            self.refused["too_many"] += 1
            return TOO_MANY
        self.open[client] = self.open.get(client, 0) + 1
        self.total += 1
        return None

    def release(self, client: str) -> None:
        self.total -= 1
        left = self.open.get(client, 0) - 1
        if left > 0:
            self.open[client] = left
        else:
            self.open.pop(client, None)

    def collect(self):
        family = CounterMetricFamily(
            self.metric, f"Client connections closed by {self.who}'s limits", labels=["reason"]
        )
        for reason in REASONS:
            family.add_metric([reason], self.refused[reason])
        yield family
        yield GaugeMetricFamily(
            self.metric.removesuffix("_refused") + "_open", f"Client connections open on {self.who}", value=self.total
        )

    def protocol_class(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol with this guard's limits (pass as ``uvicorn.Config(http=...)``)."""
        return type("GuardedH11Protocol", (_GuardedH11,), {"guard": self})


def server_guard(settings) -> ConnectionGuard:
    """A prefill or decode server's guard, from its ``ServerSettings``."""
    return ConnectionGuard(
        settings.header_timeout_s,
        settings.body_timeout_s,
        settings.max_connections_per_client,
        max_connections=settings.max_connections,
        reserved=settings.reserved_connections,
        trusted=settings.trusted_clients,
        metric="pdserve_connections_refused",
        who="the server",
    )


class _GuardedH11(H11Protocol):
    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._claimed: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        client = self.client[0] if self.client else ""
        refusal = self.guard.claim(client)
        if refusal is not None:
            transport.write(refusal)
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
        if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self._disarm()  # idle between requests: uvicorn's keep-alive timer closes it in time
        else:
            self._follow()  # the next request had begun to arrive

    def _follow(self) -> None:
        """Header timer while a request's headers arrive, body timer while its body does, none after."""
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
