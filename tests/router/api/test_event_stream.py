"""``EventStream`` (router/api/event_stream.py) as an ASGI response, its server's ``receive`` and
``send`` played by the test: the writes it makes, and what a client's disconnect does to its body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
from starlette.background import BackgroundTask
from starlette.types import Message

from router.api.event_stream import EventStream


class Connection:
    """The server's side of one response: the messages sent, and a disconnect to give on ``receive``."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.gone = asyncio.Event()
        self.told = asyncio.Event()  # receive has given the disconnect
        self.write_blocks: asyncio.Event | None = None  # set: writes wait on it (a client that reads slowly)
        self.wrote = asyncio.Event()  # a body's write has begun

    async def receive(self) -> Message:
        await self.gone.wait()
        self.told.set()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body":
            self.wrote.set()
        if self.write_blocks is not None and message["type"] == "http.response.body":
            await self.write_blocks.wait()

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


class Body:
    """A body that yields batches of events, waiting on ``step`` between batches; records its end."""

    def __init__(self, batches: list[list[str]]) -> None:
        self.batches = batches
        self.step = asyncio.Event()
        self.waiting = asyncio.Event()
        self.closed_by: str | None = None

    async def events(self) -> AsyncIterator[str]:
        try:
            for i, batch in enumerate(self.batches):
                if i:
                    self.waiting.set()
                    await self.step.wait()
                    self.step.clear()
                for event in batch:
                    yield event
            self.closed_by = "end"
        except asyncio.CancelledError:
            self.closed_by = "cancelled"
            raise
        except GeneratorExit:
            self.closed_by = "closed"
            raise


def events(*names: str) -> list[str]:
    return [f"data: {n}\n\n" for n in names]


async def run(response: EventStream, conn: Connection) -> None:
    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, conn.receive, conn.send)


def test_each_event_is_one_write_in_order_and_the_end_one_more():
    async def main() -> None:
        conn, body = Connection(), Body([events("a", "b"), events("c")])
        closed: list[bool] = []

        async def background() -> None:
            closed.append(True)

        task = asyncio.create_task(run(EventStream(body.events(), background=BackgroundTask(background)), conn))
        await body.waiting.wait()
        assert conn.bodies() == [b"data: a\n\n", b"data: b\n\n"]  # out before the body waits
        body.step.set()
        await task
        assert conn.sent[0]["type"] == "http.response.start" and conn.sent[0]["status"] == 200
        headers = dict(conn.sent[0]["headers"])
        assert headers[b"content-type"].startswith(b"text/event-stream")
        assert headers[b"cache-control"] == b"no-cache"
        assert conn.bodies() == [b"data: a\n\n", b"data: b\n\n", b"data: c\n\n", b""]
        assert [m["more_body"] for m in conn.sent[1:]] == [True, True, True, False]
        assert body.closed_by == "end" and closed == [True]

    asyncio.run(main())


def test_a_disconnect_while_the_body_waits_cancels_it_there_and_runs_the_background_task():
    async def main() -> None:
        conn, body = Connection(), Body([events("a"), events("never")])
        closed: list[bool] = []

        async def background() -> None:
            closed.append(True)

        task = asyncio.create_task(run(EventStream(body.events(), background=BackgroundTask(background)), conn))
        await body.waiting.wait()
        conn.gone.set()
        await task  # the response ends quietly: no exception, the task not left cancelled
        assert not task.cancelled() and task.exception() is None
        assert body.closed_by == "cancelled" and closed == [True]
        assert conn.bodies() == [b"data: a\n\n"]

    asyncio.run(main())


def test_a_disconnect_while_a_write_waits_closes_the_body():
    async def main() -> None:
        conn, body = Connection(), Body([events("a"), events("b")])
        conn.write_blocks = asyncio.Event()
        task = asyncio.create_task(run(EventStream(body.events()), conn))
        await conn.wrote.wait()  # the first write has begun, and blocks
        conn.gone.set()
        await task
        assert body.closed_by == "closed"  # at its yield: closed, its finally run
        assert conn.bodies() == [b"data: a\n\n"]

    asyncio.run(main())


def test_a_cancellation_from_elsewhere_goes_on():
    async def main() -> None:
        conn, body = Connection(), Body([events("a"), events("b")])
        task = asyncio.create_task(run(EventStream(body.events()), conn))
        await body.waiting.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert task.cancelled() and body.closed_by == "cancelled"

    asyncio.run(main())


def test_a_disconnect_after_the_last_event_leaves_the_bodys_shielded_close_to_finish():
    """As a client that stops reading at ``[DONE]`` and hangs up: the body's ``finally`` (the router's
    session close, shielded as in ``OpenAIHandlers.close``) is under way when the disconnect comes,
    and runs to its end."""

    async def main() -> None:
        conn = Connection()
        closing, may_finish = asyncio.Event(), asyncio.Event()
        steps: list[str] = []

        async def body() -> AsyncIterator[str]:
            try:
                yield "data: [DONE]\n\n"
            finally:
                with anyio.CancelScope(shield=True):
                    closing.set()
                    await may_finish.wait()
                    steps.append("closed")

        task = asyncio.create_task(run(EventStream(body()), conn))
        await closing.wait()
        conn.gone.set()
        await conn.told.wait()  # the disconnect is seen while the close waits
        may_finish.set()
        await task
        assert steps == ["closed"]
        assert not task.cancelled() and task.exception() is None
        assert conn.bodies() == [b"data: [DONE]\n\n", b""]

    asyncio.run(main())
