"""Waiting in tests: on a condition, with a deadline, never a bare sleep.

A test that needs another task, thread or process to get somewhere first
waits until the condition that says it got there holds; it fails with
``what`` once ``timeout`` passes. The poll interval only bounds how late the
wait notices, never whether the test passes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

POLL_S = 0.02  # some conditions ask a server over HTTP: poll gently


DEFAULT_TIMEOUT_S = 10.0


def _named(predicate: Callable[[], bool], what: str | None) -> str:
    """``what``, or the predicate's own source line when the caller gave none."""
    if what is not None:
        return what
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


async def until(predicate: Callable[[], bool], timeout: float = DEFAULT_TIMEOUT_S, what: str | None = None) -> None:
    """Return once ``predicate()`` holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {_named(predicate, what)}"
        await asyncio.sleep(POLL_S)


def wait_until(predicate: Callable[[], bool], timeout: float = DEFAULT_TIMEOUT_S, what: str | None = None) -> None:
    """``until`` for code outside an event loop (threads, processes)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {_named(predicate, what)}"
        time.sleep(POLL_S)
