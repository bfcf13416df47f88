"""Recent requests' stage timestamps, served on ``GET /debug/timeline``.

Each process (router, decode, prefill server) keeps the last ``capacity``
requests it handled: the request id and when each of its stages began or
ended, as Unix time, so that timelines from several processes on one
machine (or synchronised clocks) line up. ``pdserve bench serve --timeline``
joins them by request id into one picture (bench/load/timeline.py). Event loop
only; bounded, so it costs a few hundred bytes a request and no more.
"""

from __future__ import annotations

import time
from collections import deque


class TimelineLog:
    CAPACITY = 4096

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._entries: deque[dict] = deque(maxlen=capacity)
        self._offset = time.time() - time.monotonic()  # monotonic -> Unix time, one offset for all stamps

    def add(self, request_id: str, **stamps: float | None) -> None:
        """``stamps``: stage name -> ``time.monotonic()`` reading (None: the stage did not happen)."""
        entry = {"request_id": request_id}
        entry.update({k: round(v + self._offset, 6) for k, v in stamps.items() if v is not None})
        self._entries.append(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[dict]:
        return list(self._entries)
