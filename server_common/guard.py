"""What every pdserve process uses to guard itself: bearer checks, the internal
shared secret, and draining (stop taking work, finish what is in flight).

Internal servers (prefill, decode) accept calls only with
``Authorization: Bearer <internal secret>`` when the cluster config sets one;
``/health`` and ``/metrics`` stay open for probes and Prometheus. The secret
is compared in constant time and never logged.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable, Iterable

from fastapi.responses import JSONResponse

from transfer.outcome import Outcome
from wire.replies import ErrorReply

OPEN_PATHS = frozenset({"/health", "/metrics"})


def bearer_token(authorization: str) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` header value ("" when absent)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def token_matches(token: str, accepted: Iterable[str]) -> bool:
    """Constant-time comparison against every accepted value (no early exit on a match)."""
    hits = [hmac.compare_digest(token.encode(), key.encode()) for key in accepted]
    return bool(token) and any(hits)


def auth_headers(secret: str | None) -> dict[str, str]:
    """Headers a process sends to an internal server of its cluster."""
    return {"authorization": f"Bearer {secret}"} if secret else {}


class InternalAuthMiddleware:
    """Pure ASGI: 401 for any call without the cluster's internal secret, except ``open_paths``."""

    def __init__(self, app, secret: str | None, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._secret = secret
        self._open = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self._secret or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        token = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
        if token_matches(token, [self._secret]):
            await self.app(scope, receive, send)
            return
        body = (
            ErrorReply(error="missing or wrong internal secret", code=Outcome.UNAUTHORIZED).model_dump_json().encode()
        )
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class BodyCapMiddleware:
    """Pure ASGI: 413 for a body over ``max_bytes``, refused on its declared
    length before a byte is read, or as soon as the bytes read pass the cap
    (so a body costs the server at most ``max_bytes`` of memory). No response
    is buffered, so streams and disconnects still work. ``refusal_body``: the
    JSON of the 413 (the router answers in OpenAI's error shape; by default an
    internal server's ``ErrorReply``)."""

    def __init__(self, app, max_bytes: int, refusal_body: Callable[[str], bytes] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._refusal_body = refusal_body or (
            lambda message: ErrorReply(error=message, code=Outcome.TOO_LARGE).model_dump_json().encode()
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the caller left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send)
                return
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnect notices
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = self._refusal_body(f"request body is larger than {self.max_bytes} bytes")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def install_guard(app, secret: str | None, drain: Drain) -> None:
    """The internal secret on every route but /health and /metrics, and the drain admin routes:
    ``POST /admin/drain`` (stop taking work, finish what is in flight; /health then says
    "draining") and ``POST /admin/resume``. Both answer ``{"draining": ..., "inflight": ...}``."""
    app.add_middleware(InternalAuthMiddleware, secret=secret)

    @app.post("/admin/drain")
    async def admin_drain() -> JSONResponse:
        drain.start()
        return JSONResponse(drain.status())

    @app.post("/admin/resume")
    async def admin_resume() -> JSONResponse:
        drain.resume()
        return JSONResponse(drain.status())


class Drain:
    """Draining: refuse new work (the caller checks ``draining``), let the work in flight finish.

    ``inflight`` counts the work in flight; ``wait_idle`` polls it. Started by
    an admin call or by SIGTERM (``server_common.run``); ``resume`` undoes an
    admin drain.
    """

    POLL_S = 0.05

    def __init__(self, inflight: Callable[[], int], on_start: Callable[[], None] | None = None) -> None:
        self._inflight = inflight
        self._on_start = on_start  # called once when draining starts (a decode server moves its streams off)
        self.draining = False
        self.since: float | None = None

    def start(self) -> None:
        if not self.draining:
            self.draining, self.since = True, time.monotonic()
            if self._on_start is not None:
                self._on_start()

    def resume(self) -> None:
        self.draining, self.since = False, None

    @property
    def inflight(self) -> int:
        return self._inflight()

    async def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self._inflight() > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.POLL_S)
        return True

    def status(self) -> dict:
        return {"draining": self.draining, "inflight": self.inflight}
