"""Fixtures of the router's connection tests (test_net_backend.py, test_h1_client.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import uvloop


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request) -> Callable[[Awaitable[None]], None]:
    """Runs a test's coroutine to its end on the loop the parameter names."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def go(coro: Awaitable[None]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(coro)  # type: ignore[arg-type]

    return go
