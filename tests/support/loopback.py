"""Scripted servers on 127.0.0.1 for the router's connection tests: a handler per connection, and a port
nothing listens on."""

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
