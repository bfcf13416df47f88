"""``EventStream``: a streamed response (server-sent events) without a task group per response.

Starlette's ``StreamingResponse`` runs each response in an anyio task group: the body in one
task, a listener for the client's disconnect in the other, the body's task cancelled when the
client goes away. At one request at a time that machinery is a measurable part of what the
router adds (bench/README.md, ``pdserve bench router``). ``EventStream`` sends the body from the
request's own task and waits for the disconnect in one plain task; when the client goes away,
the body is cancelled where it waits, as there (its ``finally`` closes the request's sessions:
the request is aborted on the servers and its blocks freed), and the stream ends quietly. The
background task runs after the body either way, as ``StreamingResponse`` runs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Disconnect:
    """Watches one response's ``receive`` for the client's disconnect; while the body streams,
    a disconnect cancels the task that streams it."""

    def __init__(self, receive: Receive, streaming: asyncio.Task) -> None:
        self.streaming: asyncio.Task | None = streaming  # None once the body is done: nothing to cancel
        self.seen = False
        self.cancelled = False  # whether this watcher cancelled the body's task
        self._watch = asyncio.ensure_future(self._listen(receive))

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.seen = True
        if self.streaming is not None:
            self.cancelled = True
            self.streaming.cancel()

    def stop(self) -> None:
        """The body is done (or failed): a disconnect from now on cancels nothing."""
        self.streaming = None
        if not self._watch.done():
            self._watch.cancel()


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
        task = asyncio.current_task()
        assert task is not None  # ASGI apps run in a task
        disconnect = _Disconnect(receive, task)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await self._send_body(send, disconnect)
        except asyncio.CancelledError:
            if not disconnect.cancelled:
                raise
            task.uncancel()  # our own cancel, for the client that left: the response is over
            await self._close_body()
        finally:
            disconnect.stop()
        if self.background is not None:
            await self.background()

    async def _send_body(self, send: Send, disconnect: _Disconnect) -> None:
        async for event in self.body_iterator:
            if disconnect.seen:
                await self._close_body()
                return
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        disconnect.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close_body(self) -> None:
        """The body closed (its ``finally`` run) when the client left while it was not waiting, where
        the cancellation could not reach it."""
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            await close()
