"""Freed memory goes back to the system after a large request.

CPython hands strings and buffers over 512 bytes to glibc's malloc. After a
freed large block glibc raises its mmap threshold (up to 32 MiB), so the next
multi-megabyte prompts and answers come from the heap, and when they are freed
the heap keeps the pages: a router that took eight 4 MiB prompts at once held
1.4 GB more than before, for good. ``malloc_trim(0)`` returns the free pages
of every arena. It runs on a thread (it walks the heap), at most one at a time,
once a request that moved at least ``threshold`` bytes (its body and its
answer) has been answered, refused or abandoned: ``TrimAfterLargeRequests``
counts them around the whole app, so that the request's objects are gone by
then. Where glibc is not the allocator (musl, macOS) it does nothing.

The prefill and decode servers trim on a clock instead (``trim_while_busy``):
their engine thread frees and allocates oneDNN kernels and step buffers of
every size in its own arena, and the pages freed there stayed with the
process, a few MB every few minutes under a steady mix of prompt lengths
(bench/README.md, "Memory under a steady load"). Once a minute while the
engine stepped, and once more after it stopped, the free pages go back.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
TRIM_INTERVAL_S = 60.0


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class Trimmer:
    def __init__(self, threshold: int = 1 << 20) -> None:
        self.threshold = threshold
        self.trims = 0  # malloc_trim calls made
        self._trim = _malloc_trim()
        self._running = threading.Lock()

    def after(self, nbytes: int) -> None:
        """A request that moved ``nbytes`` (its body and its answer) has ended; its memory is free."""
        if self._trim is None or nbytes < self.threshold or not self._running.acquire(blocking=False):
            return
        threading.Thread(target=self._run, name="malloc-trim", daemon=True).start()

    def trim_now(self) -> None:
        """``malloc_trim(0)`` on this thread (where there is one), unless a trim is running."""
        if self._trim is None or not self._running.acquire(blocking=False):
            return
        self._run()

    def _run(self) -> None:
        try:
            self._trim(0)
            self.trims += 1
        finally:
            self._running.release()


class TrimAfterLargeRequests:
    """Pure ASGI: counts each HTTP request's body and response bytes; after the app is done with
    the request (the response sent, or the client gone), ``trimmer.after`` those bytes."""

    def __init__(self, app, trimmer: Trimmer) -> None:
        self.app = app
        self.trimmer = trimmer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        moved = 0

        async def counted_receive():
            nonlocal moved
            message = await receive()
            moved += len(message.get("body", b""))
            return message

        async def counted_send(message) -> None:
            nonlocal moved
            moved += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counted_receive, counted_send)
        finally:
            self.trimmer.after(moved)


async def trim_while_busy(
    trimmer: Trimmer, activity: Callable[[], object], interval_s: float = TRIM_INTERVAL_S
) -> None:
    """Until cancelled: every ``interval_s``, a trim on a worker thread if ``activity()`` (a value that
    changes while the server works, such as its engine's step counts) changed since the last trim."""
    trimmed_at = activity()
    while True:
        await asyncio.sleep(interval_s)
        now = activity()
        if now != trimmed_at:
            trimmed_at = now
            await asyncio.to_thread(trimmer.trim_now)
