"""httpcore's network streams on asyncio's own transports, for the router's client to the workers.

A decode stream reaches the router as one small read per token. httpcore's
default backend reads through anyio: every read enters a cancel scope
(``fail_after``, which asks sniffio and ``asyncio.current_task`` which event
loop runs it, twice) and a stream wrapper of its own, whose cost is paid per
token and was about a sixth of the router's CPU on a streamed answer.
``AsyncioBackend`` gives httpcore the same four operations (connect, read,
write, close; TLS by ``loop.start_tls``) on an ``asyncio.Protocol``: a read
takes what the transport already buffered, or waits on one future, with a
timer only when there is a timeout.

What httpcore and httpx see is unchanged: the same exceptions (``ConnectError``,
``ConnectTimeout``, ``ReadError``, ``ReadTimeout``, ``WriteError``,
``WriteTimeout``), ``b""`` at the end of the stream, and ``is_readable``
(the pool's test whether the server closed an idle connection: data or the
end already arrived). Reading stops while ``HIGH_WATER`` bytes wait unread,
so a slow reader bounds what a fast worker can make it hold.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Iterable
from typing import Any

import httpcore
from httpcore._backends.base import SOCKET_OPTION

HIGH_WATER = 1 << 20  # bytes buffered unread at which the transport stops reading (resumed below a quarter)


class _Connection(asyncio.Protocol):
    """What the transport delivered and has not been read yet, and the one reader or writer waiting."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.ended = False  # the peer ended its side, or the connection is gone
        self.error: BaseException | None = None  # why the connection was lost, when it was by an error
        self.reading_paused = False
        self.writing_paused = False
        self.readable: asyncio.Future | None = None
        self.drained: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is a Transport without the base class

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered >= HIGH_WATER and not self.reading_paused and self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True
        wake(self.readable)

    def eof_received(self) -> bool:
        self.ended = True
        wake(self.readable)
        return False  # the transport closes: HTTP/1.1 writes nothing after the server's end

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        wake(self.readable)
        wake(self.drained)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        wake(self.drained)


def wake(waiter: asyncio.Future | None) -> None:
    """Resolves ``waiter``, the one reader or writer a protocol's callback may be keeping waiting (none: nothing)."""
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _expire(waiter: asyncio.Future, kind: type[Exception], what: str) -> None:
    if not waiter.done():
        waiter.set_exception(kind(what))


async def wait_for(waiter: asyncio.Future, timeout: float | None, kind: type[Exception], what: str) -> None:
    """``waiter``, or ``kind(what)`` raised after ``timeout`` s (a timer only when there is one); also
    router/cluster/h1_client.py's."""
    if timeout is None:
        await waiter
        return
    timer = asyncio.get_running_loop().call_later(timeout, _expire, waiter, kind, what)
    try:
        await waiter
    finally:
        timer.cancel()


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, connection: _Connection) -> None:
        self._conn = connection
        self._loop = asyncio.get_running_loop()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        conn = self._conn
        if not conn.chunks and not conn.ended:
            conn.readable = self._loop.create_future()
            try:
                await wait_for(conn.readable, timeout, httpcore.ReadTimeout, "no data within the read timeout")
            finally:
                conn.readable = None
        if not conn.chunks:
            if conn.error is not None:
                raise httpcore.ReadError(str(conn.error) or repr(conn.error)) from conn.error
            return b""  # the end of the stream
        data = conn.chunks.popleft()
        if len(data) > max_bytes:
            conn.chunks.appendleft(data[max_bytes:])
            data = data[:max_bytes]
        conn.buffered -= len(data)
        if conn.reading_paused and conn.buffered < HIGH_WATER // 4 and conn.transport is not None:
            conn.reading_paused = False
            conn.transport.resume_reading()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        conn = self._conn
        transport = conn.transport
        if transport is None or transport.is_closing() or conn.error is not None:
            raise httpcore.WriteError(f"connection closed{f': {conn.error}' if conn.error else ''}")
        transport.write(buffer)
        if conn.writing_paused:
            conn.drained = self._loop.create_future()
            try:
                await wait_for(conn.drained, timeout, httpcore.WriteTimeout, "nothing written within the write timeout")
            finally:
                conn.drained = None
            if conn.error is not None:
                raise httpcore.WriteError(str(conn.error) or repr(conn.error)) from conn.error

    async def aclose(self) -> None:
        if self._conn.transport is not None:
            self._conn.transport.close()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        transport = self._conn.transport
        assert transport is not None
        fresh = _Connection()  # the TLS transport delivers to a new protocol: nothing read yet is lost (none was)
        try:
            tls = await self._loop.start_tls(
                transport, fresh, ssl_context, server_hostname=server_hostname, ssl_handshake_timeout=timeout
            )
        except TimeoutError as exc:
            transport.close()
            raise httpcore.ConnectTimeout(f"TLS handshake took over {timeout} s") from exc
        except (OSError, ssl.SSLError) as exc:
            transport.close()
            raise httpcore.ConnectError(str(exc)) from exc
        assert tls is not None
        fresh.connection_made(tls)
        return AsyncioStream(fresh)

    def get_extra_info(self, info: str) -> Any:
        transport = self._conn.transport
        if info == "is_readable":  # something to read now: data, the end, or a lost connection
            return bool(self._conn.chunks) or self._conn.ended or transport is None or transport.is_closing()
        if transport is None:
            return None
        if info == "ssl_object":
            return transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return transport.get_extra_info("sockname")
        if info == "server_addr":
            return transport.get_extra_info("peername")
        if info == "socket":
            return transport.get_extra_info("socket")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if socket_options:
            raise ValueError("AsyncioBackend: socket_options are not supported")
        local = (local_address, 0) if local_address else None
        return await self._connect(
            lambda conn: asyncio.get_running_loop().create_connection(lambda: conn, host, port, local_addr=local),
            timeout,
            f"{host}:{port}",
        )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if socket_options:
            raise ValueError("AsyncioBackend: socket_options are not supported")
        return await self._connect(
            lambda conn: asyncio.get_running_loop().create_unix_connection(lambda: conn, path), timeout, path
        )

    @staticmethod
    async def _connect(open_with: Any, timeout: float | None, where: str) -> httpcore.AsyncNetworkStream:
        conn = _Connection()
        try:
            async with asyncio.timeout(timeout):
                await open_with(conn)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"connecting to {where} took over {timeout} s") from exc
        except (OSError, socket.gaierror) as exc:
            raise httpcore.ConnectError(str(exc) or repr(exc)) from exc
        return AsyncioStream(conn)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
