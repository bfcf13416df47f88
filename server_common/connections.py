"""Slow and greedy clients: header and body timeouts, open connections per client.

uvicorn closes idle keep-alive connections but waits forever for a request
that arrives a byte at a time, so a few dozen slow clients could hold a
server's connections indefinitely. ``ConnectionGuard`` gives uvicorn's
httptools protocol (``protocol_class``) these limits, on the router (config
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
  everyone;
* ``MAX_HEADER_BYTES``: a request's line and headers; llhttp (httptools'
  parser) sets no limit of its own, so past it the request is answered 431;
* ``MAX_PIPELINED``: requests sent ahead on one connection while an earlier
  one is served (llhttp parses all of a read at once, where h11 took one
  request at a time): those past it are dropped unread, and the connection
  closes once the ones before them are answered.

httptools rather than h11: the router parses and frames every request and
streamed chunk through this protocol, and llhttp does in C what h11's state
machine does in Python per event (``pdserve bench router --against``: less
CPU per token; bench/README.md). A request uvicorn cannot parse is answered
uvicorn's 400, as before.

A connection that passes a limit is closed and counted in
``pdserve_router_connections_refused{reason="header_timeout|body_timeout|too_many|full|header_too_large|pipelined"}``
(``pdserve_connections_refused`` on the servers); the connections open now are
``pdserve_router_connections_open`` (``pdserve_connections_open``).
A response being streamed is never cut: the timers stop once the request has
been read, and a next request's start only once that response has ended.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REASONS = ("header_timeout", "body_timeout", "too_many", "full", "header_too_large", "pipelined")
LOOPBACK = frozenset({"127.0.0.1", "::1"})
FD_HEADROOM = 256  # descriptors kept for everything but client connections (model files, peers, pipes)
MAX_HEADER_BYTES = 16 * 1024  # a request's line and headers; as uvicorn's h11 protocol allowed
MAX_PIPELINED = 16  # requests read on one connection while an earlier one is served


def _refusal(message: str, status: str = "503 Service Unavailable", code: str = "too_many_connections") -> bytes:
    """What a connection refused here gets before it is closed: in OpenAI's error shape, which the
    servers' ErrorReply readers take as well. A 503 asks the client to retry in a second."""
    kind, retry = ("server_error", "retry-after: 1\r\n") if status.startswith("503") else ("invalid_request_error", "")
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, separators=(",", ":")
    ).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{retry}connection: close\r\n"
    return f"{head}content-length: {len(body)}\r\n\r\n".encode() + body


TOO_MANY = _refusal("too many open connections from this address; close some and retry")
FULL = _refusal("the server has too many open connections; retry shortly")
HEADER_TOO_LARGE = _refusal(
    f"the request line and headers are over {MAX_HEADER_BYTES} bytes",
    "431 Request Header Fields Too Large",
    "request_header_fields_too_large",
)


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

    def protocol_class(self) -> type[HttpToolsProtocol]:
        """uvicorn's httptools protocol with this guard's limits (pass as ``uvicorn.Config(http=...)``)."""
        return type("GuardedHttpToolsProtocol", (_GuardedHttpTools,), {"guard": self})


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


class _GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, in C) with the guard's caps, timers and limits.

    What is being read decides the timer: a request's headers (from the connection's start, or the
    first byte of a kept-alive connection's next request), then its body, then none. A request read
    while an earlier response is still being written waits on the server, not on its client: its
    timer starts when that response ends."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._claimed: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        self._reading = "headers"  # what is awaited: "headers", "body", or "" between requests
        self._in_message = False  # the parser is inside a request (from its first byte to its end)
        self._read_size, self._read_starts_request = 0, True
        self._header_bytes = 0
        self._dropping = False  # past MAX_PIPELINED: nothing more is read
        client = self.client[0] if self.client else ""
        refusal = self.guard.claim(client)
        if refusal is not None:
            transport.write(refusal)
            transport.close()  # after the write is flushed
            return
        self._claimed = client
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._claimed is not None:
            self.guard.release(self._claimed)
            self._claimed = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        self._read_size, self._read_starts_request = len(data), not self._in_message
        super().data_received(data)
        if self._reading == "headers" and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse_headers()

    def on_message_begin(self) -> None:
        if self._dropping:
            return
        super().on_message_begin()
        self._reading, self._in_message = "headers", True
        # A request that began after an earlier one within a read is counted from the next read
        # (where in the read it began is not known): one read more, at most, before the limit.
        self._header_bytes = 0 if self._read_starts_request else -self._read_size
        self._read_starts_request = False
        self._follow()

    def on_url(self, url: bytes) -> None:
        if not self._dropping:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._dropping:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._dropping:
            return
        if len(self.pipeline) >= MAX_PIPELINED:
            self._drop_the_rest()
            return
        self._reading = "body"
        super().on_headers_complete()  # starts the request, or queues it behind the one in flight
        self._follow()

    def on_body(self, body: bytes) -> None:
        if not self._dropping:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._dropping:
            return
        super().on_message_complete()
        self._reading, self._in_message = "", False
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts a queued request, if any
        self._follow()

    def _follow(self) -> None:
        """Header timer while a request's headers arrive, body timer while its body does, none
        while the server is the one that keeps it waiting, or between requests."""
        if self._reading == "headers" and (self.cycle is None or self.cycle.response_complete):
            if self._phase != "header_timeout":
                self._arm("header_timeout", self.guard.header_timeout_s)
        elif self._reading == "body" and not self.pipeline:
            if self._phase != "body_timeout":
                self._arm("body_timeout", self.guard.body_timeout_s)
        else:
            self._disarm()  # idle between requests: uvicorn's keep-alive timer closes it in time

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, ""

    def _expired(self) -> None:
        self.guard.refused[self._phase] += 1
        self._timer, self._phase = None, ""
        if not self.transport.is_closing():
            self.transport.close()

    def _drop_the_rest(self) -> None:
        """Past ``MAX_PIPELINED`` queued requests: this one and all after it are dropped unread, and the
        connection closes after the last queued request's response (sent with ``connection: close``)."""
        self._dropping = True
        self._reading, self._in_message = "", False
        self.guard.refused["pipelined"] += 1
        self.pipeline[0][0].keep_alive = False  # the newest queued; appendleft'ed by uvicorn
        self._follow()

    def _refuse_headers(self) -> None:
        """llhttp sets no limit on a request's headers; past ``MAX_HEADER_BYTES`` the connection gets
        a 431 (unless a response is being written on it) and is closed."""
        self._disarm()
        self.guard.refused["header_too_large"] += 1
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(HEADER_TOO_LARGE)
        self.transport.close()
