"""``EventStream``: a streamed response (server-sent events) without a task group per response.

Starlette's ``StreamingResponse`` runs each response in an anyio task group: the body in a new
task, a listener for the client's disconnect in the request's, the group's cancel scope cancelled
when the client goes away. At one request at a time that machinery is a measurable part of what
the router adds (bench/README.md, ``pdserve bench router``). ``EventStream`` sends the body from the
request's own task inside one anyio cancel scope, and waits for the disconnect in one plain task
that cancels that scope.

The cancellation is anyio's, as in ``StreamingResponse``, not ``Task.cancel``: the streams close
their sessions in a shielded scope (``OpenAIHandlers.close``), and a client that hangs up just
after ``[DONE]`` would otherwise cancel that close half-way (the request's sessions left open, its
timeline not written). The background task runs after the body either way, as there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import anyio
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class EventStream(Response):
    """A ``text/event-stream`` response whose body is an async iterator of events (``str``)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        headers: Mapping[str, str] | None = None,
        background: BackgroundTask | None = None,
    ) -> None:
        self.body_iterator = content
        self.status_code = 200
        self.background = background
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with anyio.CancelScope() as body:
            watch = asyncio.ensure_future(_cancel_on_disconnect(receive, body))
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for event in self.body_iterator:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                watch.cancel()
        if body.cancelled_caught:
            await self._close_body()
        if self.background is not None:
            await self.background()

    async def _close_body(self) -> None:
        """The body closed (its ``finally`` run) when the client left while it was not waiting, where
        the cancellation did not reach it; a body that ended already is left as it is."""
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            await close()
