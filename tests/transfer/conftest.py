"""Fixtures of the transfer tests."""

from __future__ import annotations

import pytest

from tests.transfer.procs import Peer
from transfer.inproc import InprocHub


@pytest.fixture
def peers():
    """Start peers with ``peers(role, cfg)``; every one is stopped by its pid."""
    started: list[Peer] = []

    def start(role: str, cfg: dict) -> Peer:
        peer = Peer(role, cfg)
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.stop()


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def hub():
    """One in-process fabric for the senders and receivers of a test."""
    return InprocHub()


@pytest.fixture
def closing():
    """``closing(side)`` returns ``side`` and closes it when the test ends, passed or failed."""
    sides = []
    yield lambda side: sides.append(side) or side
    for side in sides:
        side.close()
