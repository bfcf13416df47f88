"""Freed memory goes back to the system after a large request.

CPython hands strings and buffers over 512 bytes to glibc's malloc. After a
freed large block glibc raises its mmap threshold (up to 32 MiB), so the next
multi-megabyte prompts and answers come from the heap, and when they are freed
the heap keeps the pages: a router that took eight 4 MiB prompts at once held
1.4 GB more than before, for good. ``malloc_trim(0)`` returns the free pages
of every arena. It runs on a thread (it walks the heap), at most one at a time,
only after requests that moved at least ``threshold`` bytes. Where glibc is not
the allocator (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)


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

    def _run(self) -> None:
        try:
            self._trim(0)
            self.trims += 1
        finally:
            self._running.release()
