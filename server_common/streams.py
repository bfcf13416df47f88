"""Per-request queues that the engine thread feeds and the event loop reads."""

from __future__ import annotations

import asyncio
from typing import Any


class StreamHub:
    """request id -> asyncio.Queue on one event loop; ``publish`` is safe from any thread.

    Items for a request nobody listens to any more (it ended, the client left)
    are dropped.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queues: dict[str, asyncio.Queue] = {}  # touched on the loop thread only

    def open(self, request_id: str) -> asyncio.Queue:
        if request_id in self._queues:
            raise KeyError(f"request id {request_id!r} is already active")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def __len__(self) -> int:
        return len(self._queues)

    def publish(self, request_id: str, item: Any) -> None:
        self._loop.call_soon_threadsafe(self._deliver, request_id, item)

    def publish_many(self, items: list[tuple[str, Any]]) -> None:
        """``(request_id, item)`` pairs in order, with one wake-up of the loop for all of them
        (an engine step's tokens for every stream at once)."""
        if items:
            self._loop.call_soon_threadsafe(self._deliver_many, items)

    def _deliver(self, request_id: str, item: Any) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(item)

    def _deliver_many(self, items: list[tuple[str, Any]]) -> None:
        for request_id, item in items:
            self._deliver(request_id, item)
