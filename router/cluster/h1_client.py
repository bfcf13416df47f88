"""The router's requests to the workers (``/generate``, ``/prefill``, ``/abort``): HTTP/1.1 of its own.

Under load, httpx and httpcore were half of the router's CPU (``pdserve bench
router --profile``): per request, the client's layers (auth, redirects, the
pool's scan, a trace per step, h11's state machine in Python), and per
streamed token a read through the same layers and one h11 event. The calls
the router makes to its workers are few and plain (a POST with a JSON body,
an answer with a length or chunked), so ``H1Client`` makes them on an
``asyncio.Protocol`` of its own and parses the answer with httptools (C, the
parser uvicorn uses): the answer's head and body arrive by callbacks while
the transport delivers them, a body's chunks wait in the connection until
read, and a read takes all of them at once, so a burst of token events is
one read for the decode stream's line splitter.

What callers see is what httpx gave them: the same exceptions
(``ConnectError``/``ConnectTimeout``/``PoolTimeout`` before anything was
sent, ``ReadTimeout`` when no byte came within the read timeout,
``ReadError`` on a reset, ``RemoteProtocolError`` for an answer cut short or
malformed, ``WriteError``/``WriteTimeout``), a ``status_code``, ``headers``
and ``content``, and for a streamed answer ``aiter_bytes`` and ``aclose``.

Connections are kept alive: one goes back to the pool once its answer was
read to the end (and the server did not ask to close it), at most
``max_keepalive`` of them idle, each for ``keepalive_s`` (below the servers'
own keep-alive timeout, so the router never reuses one the server is about
to close); one the server closed while idle leaves the pool when it closes.
At most ``max_connections`` are open; a request that finds them all busy
waits for one (``PoolTimeout`` after its timeout), and one that finds idle
connections to other servers closes one to open its own. A streamed answer
closed before its end closes its connection. Reading stops while
``HIGH_WATER`` bytes wait unread, so a slow reader bounds what a fast worker
can make it hold.

aiohttp's client (3.14: a ``ClientSession`` on a ``TCPConnector``, its
exceptions mapped to httpx's, the same calls) was measured in this client's
place with ``pdserve bench router --against`` a checkout of this one: the
router took 1.21x to 1.29x this client's CPU per request at concurrency 1 and
1.13x to 1.24x its CPU per token at 64 (16-token requests, three runs on the
shared 2-core machine), and 1.03x and 1.08x with each token alone
(``--token-delay 0.005``, 32 tokens, concurrency 8). It is kept because that
gap is aiohttp's machinery per call (a ``ClientRequest`` and its payload
object, a body-writer task, the response's ``StreamReader``), the per-request
cost this client exists to remove, and because aiohttp's pool bounds only
busy connections, not idle ones (``max_connections`` and ``max_keepalive``
would not hold).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools
import httpx

from router.cluster.net_backend import wait_for, wake

HIGH_WATER = 1 << 20  # bytes of body buffered unread at which the transport stops reading (resumed below a quarter)

Origin = tuple[str, str, int]  # scheme, host, port


@functools.lru_cache(maxsize=4096)
def _split(url: str) -> tuple[Origin, str, str]:
    """(origin, the Host header, the path with its query) of an ``http://`` or ``https://`` URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise httpx.UnsupportedProtocol(f"not an http:// or https:// URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.scheme, parts.hostname, port), parts.netloc, path


def _check_header(name: str, value: str) -> None:
    if any(c in name + value for c in "\r\n\0") or not name or ":" in name:
        raise ValueError(f"invalid header {name!r}")


class _Connection(asyncio.Protocol):
    """One connection to a worker: the answer being parsed (its head, the body's chunks not read yet,
    whether it is complete) and the one reader or writer waiting."""

    def __init__(self, client: H1Client, origin: Origin) -> None:
        self.client, self.origin = client, origin
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None  # while a request is out
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.ended = False  # the server ended its side, or the connection is gone
        self.error: Exception | None = None  # why the answer cannot be read: a reset, a malformed answer
        self.reading_paused = False
        self.writing_paused = False
        self.waiter: asyncio.Future | None = None
        self.drained: asyncio.Future | None = None
        self.idle_since = 0.0
        self.counted = True  # in the client's count of open connections
        self.idle = False

    def begin(self) -> None:
        """A new request goes out on this connection: a fresh answer to parse."""
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.headers = 0, {}
        self.head_done = self.complete = self.keep_alive = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is a Transport without the base class

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None or self.complete:  # bytes outside an answer: the connection is not reusable
            self.keep_alive = False
            self._close()
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(f"malformed answer: {exc}")
            self.keep_alive = False
            self._close()
        wake(self.waiter)

    def eof_received(self) -> bool:
        self.ended = True
        wake(self.waiter)
        return False  # the transport closes: HTTP/1.1 writes nothing after the server's end

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        if exc is not None and self.error is None:
            self.error = httpx.ReadError(str(exc) or repr(exc))
        wake(self.waiter)
        wake(self.drained)
        self.client._lost(self)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        wake(self.drained)

    # httptools' callbacks, while feed_data runs

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered >= HIGH_WATER and not self.reading_paused and self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True

    def on_message_complete(self) -> None:
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True

    # the reader's side

    def take(self) -> bytes:
        """Every body byte buffered now, in one piece."""
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        return data

    def until_eof(self) -> bool:
        """The answer's body runs to the connection's end (neither a length nor chunked)."""
        return "content-length" not in self.headers and "chunked" not in self.headers.get("transfer-encoding", "")

    def failure(self) -> Exception:
        """Why no more of the answer will come, once the connection ended before its end."""
        if self.error is not None:
            return self.error
        if not self.head_done:
            return httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class Reply:
    """A worker's answer: its status and headers; the body read (``content``) or to read (``aiter_bytes``)."""

    def __init__(self, client: H1Client, conn: _Connection, read_timeout: float | None) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self._read_timeout = read_timeout
        self.status_code = conn.status
        self.headers: dict[str, str] = conn.headers
        self.content = b""

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (all that arrived together in one piece), to its end."""
        conn = self._conn
        if conn is None:
            return
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete or (conn.ended and conn.error is None and conn.until_eof()):
                break
            if conn.ended or conn.error is not None:
                self._drop()
                raise conn.failure()
            conn.waiter = asyncio.get_running_loop().create_future()
            try:
                await wait_for(conn.waiter, self._read_timeout, httpx.ReadTimeout, "no data within the read timeout")
            except BaseException:
                self._drop()  # timed out or cancelled halfway through the body: the connection is not reusable
                raise
            finally:
                conn.waiter = None
        self._conn = None
        self._client._release(conn)

    async def aread(self) -> bytes:
        """The whole body (``content``); the connection goes back to the pool."""
        parts = [chunk async for chunk in self.aiter_bytes()]
        self.content = b"".join(parts)
        return self.content

    async def aclose(self) -> None:
        """Closes the connection when the body was not read to its end (else it is back in the pool)."""
        self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._client._drop(conn)


class H1Client:
    """Keep-alive HTTP/1.1 connections to the workers; ``headers`` go with every request (the
    cluster's internal secret). An async context manager: leaving it closes the idle connections."""

    def __init__(
        self, max_connections: int, max_keepalive: int, keepalive_s: float, headers: Mapping[str, str] | None = None
    ) -> None:
        headers = headers or {}
        for name, value in headers.items():
            _check_header(name, value)
        self._max_connections = max(1, max_connections)
        self._max_keepalive = max_keepalive
        self._keepalive_s = keepalive_s
        self._headers = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._idle: dict[Origin, list[_Connection]] = {}  # per server, the most recently used last
        self._idle_count = 0
        self._open = 0
        self._waiters: deque[asyncio.Future] = deque()  # requests waiting for room under max_connections
        self._tls: ssl.SSLContext | None = None

    async def __aenter__(self) -> H1Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for conns in list(self._idle.values()):
            for conn in list(conns):
                self._drop(conn)

    @property
    def connections(self) -> int:
        """Connections open now, idle or busy."""
        return self._open

    async def request(
        self,
        method: str,
        url: str,
        content: bytes | str = b"",
        headers: Mapping[str, str] | None = None,
        *,
        timeout: float,
        read_timeout: float | None = None,
        stream: bool = False,
    ) -> Reply:
        """Send one request and read its answer's head (and, unless ``stream``, its body).
        ``timeout``: to get a connection, to connect, to write; ``read_timeout`` (default ``timeout``):
        the longest wait for the next byte of the answer."""
        origin, host, path = _split(url)
        body = content.encode() if isinstance(content, str) else content
        head = [f"{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {len(body)}\r\n", self._headers]
        for name, value in (headers or {}).items():
            _check_header(name, value)
            head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        read_timeout = timeout if read_timeout is None else read_timeout
        conn = await self._acquire(origin, timeout)
        try:
            conn.begin()
            await self._write(conn, data, timeout)
            while not conn.head_done:
                if conn.ended or conn.error is not None:
                    raise conn.failure()
                conn.waiter = asyncio.get_running_loop().create_future()
                try:
                    await wait_for(conn.waiter, read_timeout, httpx.ReadTimeout, "no answer within the read timeout")
                finally:
                    conn.waiter = None
        except BaseException:
            self._drop(conn)
            raise
        reply = Reply(self, conn, read_timeout)
        if not stream:
            try:
                await reply.aread()
            finally:
                reply._drop()
        return reply

    async def _write(self, conn: _Connection, data: bytes, timeout: float) -> None:
        transport = conn.transport
        if transport is None or transport.is_closing() or conn.ended:
            raise httpx.WriteError("connection closed")
        transport.write(data)
        if conn.writing_paused:
            conn.drained = asyncio.get_running_loop().create_future()
            try:
                await wait_for(conn.drained, timeout, httpx.WriteTimeout, "nothing written within the write timeout")
            finally:
                conn.drained = None
            if conn.error is not None:
                raise httpx.WriteError(str(conn.error))

    # the pool

    async def _acquire(self, origin: Origin, timeout: float) -> _Connection:
        """An idle connection to ``origin`` (the most recently used), else a new one where there is room."""
        deadline = time.monotonic() + timeout
        while True:
            conn = self._reuse(origin)
            if conn is not None:
                return conn
            if self._open < self._max_connections:
                break
            if self._idle_count:  # no room, but idle connections to other servers: close the longest idle
                oldest = min((c[0] for c in self._idle.values() if c), key=lambda c: c.idle_since)
                self._drop(oldest)
                continue
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await wait_for(waiter, max(0.0, deadline - time.monotonic()), httpx.PoolTimeout, "no free connection")
            except BaseException:
                self._wake_one()  # a wake-up this waiter may have taken goes to the next one
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._open += 1
        return await self._connect(origin, timeout)

    def _reuse(self, origin: Origin) -> _Connection | None:
        """The most recently used idle connection to ``origin`` still open and young enough; older ones close."""
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            conn.idle = False
            self._idle_count -= 1
            closed = conn.ended or conn.transport is None or conn.transport.is_closing()
            if closed or now - conn.idle_since > self._keepalive_s:
                self._drop(conn)
            else:
                return conn
        return None

    async def _connect(self, origin: Origin, timeout: float) -> _Connection:
        scheme, host, port = origin
        conn = _Connection(self, origin)
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: conn, host, port, ssl=tls)
        except BaseException as exc:
            self._uncount(conn)
            if conn.transport is not None:
                conn.transport.close()
            if isinstance(exc, TimeoutError):
                raise httpx.ConnectTimeout(f"connecting to {host}:{port} took over {timeout} s") from exc
            if isinstance(exc, (OSError, ssl.SSLError)):
                raise httpx.ConnectError(str(exc) or repr(exc)) from exc
            raise
        return conn

    def _release(self, conn: _Connection) -> None:
        """``conn``'s answer was read to its end: idle in the pool if it may be reused, else closed."""
        conn.parser = None
        reusable = conn.keep_alive and conn.complete and not conn.ended and conn.error is None
        if not reusable or self._idle_count >= self._max_keepalive or conn.transport is None:
            self._drop(conn)
            return
        conn.idle, conn.idle_since = True, time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)
        self._idle_count += 1
        self._wake_one()  # a request waiting for room may close it for its own server

    def _drop(self, conn: _Connection) -> None:
        """Close ``conn`` (idempotent) and free its place."""
        self._unidle(conn)
        self._uncount(conn)
        conn.parser = None
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.close()

    def _lost(self, conn: _Connection) -> None:
        """The connection closed (the server closed an idle one, or it was dropped)."""
        self._unidle(conn)
        self._uncount(conn)

    def _unidle(self, conn: _Connection) -> None:
        if conn.idle:
            conn.idle = False
            self._idle[conn.origin].remove(conn)
            self._idle_count -= 1

    def _uncount(self, conn: _Connection) -> None:
        if conn.counted:
            conn.counted = False
            self._open -= 1
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
