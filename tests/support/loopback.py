"""Scripted servers on 127.0.0.1 for the router's connection tests: a handler per connection, a port
nothing listens on, and what a server sent before it closed a connection."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serve(handler: Handler, ssl_context: ssl.SSLContext | None = None) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=ssl_context)
    return server, server.sockets[0].getsockname()[1]


def refused_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, never listened, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_by_peer(sock: socket.socket) -> bytes | None:
    """Waits (up to the socket's timeout) for the other end to close: what it sent before its EOF
    (or before a reset, when it closed with our unread bytes in its buffer); None if it never did."""
    received = b""
    try:
        while chunk := sock.recv(1024):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return received
