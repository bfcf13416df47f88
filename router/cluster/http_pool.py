"""The router's httpx clients to the workers (health checks, KV events, discovery), with a pool scan
linear in its connections. Requests (``/generate``, ``/prefill``, ``/abort``) go on
router/cluster/h1_client.py.

httpcore's connection pool (1.0) re-examines every connection each time a
request enters or leaves it, and for each idle one counts all connections
again: quadratic in the connections, which under 64 streams in flight was a
fifth of the router's CPU (``pdserve bench router --profile``). ``LinearPool``
is the same pool with that count made once per scan; it also keeps what the
limit means: at most ``max_keepalive_connections`` *idle* connections stay
open (httpcore compares the count of all of them, so a busy pool closed
connections it was about to reuse). And it asks an idle connection whether
it expired (a ``poll`` on its socket: did the server close it?) when it is
about to be reused, and all idle ones at most every ``SWEEP_S``, instead of
every idle connection on every scan. Everything else (which connection a
request gets, when one is opened or closed) is httpcore's own code path. Its
connections are asyncio transports (``router/cluster/net_backend.py``).

An httpcore other than 1.x gets its own pool unchanged.
"""

from __future__ import annotations

import time

import httpcore
import httpx
from httpcore._async.interfaces import AsyncConnectionInterface

from router.cluster.net_backend import AsyncioBackend

SWEEP_S = 1.0  # idle connections that expired (timed out, or closed by the server) are closed this often


class LinearPool(httpcore.AsyncConnectionPool):
    _swept = 0.0

    def _assign_requests_to_connections(self) -> list[AsyncConnectionInterface]:
        """httpcore's ``AsyncConnectionPool._assign_requests_to_connections``, one pass per scan.
        (Only an idle connection can expire: a busy one has neither a keep-alive deadline nor
        a server that may close it between requests.)"""
        closing: list[AsyncConnectionInterface] = []
        kept: list[AsyncConnectionInterface] = []
        idle = 0
        now = time.monotonic()
        sweep = now - self._swept >= SWEEP_S
        if sweep:
            self._swept = now
        for connection in self._connections:
            if connection.is_closed():
                continue
            if connection.is_idle():
                if idle >= self._max_keepalive_connections or (sweep and connection.has_expired()):
                    closing.append(connection)
                else:
                    idle += 1
                    kept.append(connection)
            else:
                kept.append(connection)
        self._connections = kept

        for pool_request in [r for r in self._requests if r.is_queued()]:
            origin = pool_request.request.url.origin
            available = None
            for c in [c for c in self._connections if c.can_handle_request(origin) and c.is_available()]:
                if c.is_idle() and c.has_expired():
                    self._connections.remove(c)
                    closing.append(c)
                    continue
                available = c
                break
            if available is not None:
                pool_request.assign_to_connection(available)
                continue
            if len(self._connections) >= self._max_connections:
                idle_connection = next((c for c in self._connections if c.is_idle()), None)
                if idle_connection is None:
                    continue  # stays queued until a connection frees
                self._connections.remove(idle_connection)
                closing.append(idle_connection)
            connection = self.create_connection(origin)
            self._connections.append(connection)
            pool_request.assign_to_connection(connection)
        return closing


def worker_http(
    max_connections: int, max_keepalive: int, keepalive_s: float, headers: dict[str, str]
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for plain-HTTP calls to the workers, on a ``LinearPool``: at most
    ``max_connections`` open, ``max_keepalive`` of them idle, each idle one for ``keepalive_s``
    (``RouterSettings.worker_keepalive_s``: below the servers' keep-alive timeout)."""
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_keepalive, keepalive_expiry=keepalive_s
    )
    transport = httpx.AsyncHTTPTransport(limits=limits)
    if httpcore.__version__.startswith("1.") and type(transport._pool) is httpcore.AsyncConnectionPool:
        transport._pool = LinearPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=AsyncioBackend(),
        )
    return httpx.AsyncClient(transport=transport, headers=headers)
