"""Which worker gets the next request. Pure: no I/O, no clocks.

A policy orders the healthy candidates; the dispatcher tries them in that
order (a decode server without room answers 503 at once and the next one is
tried), so a policy never has to know about refusals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.registry import Worker
from router.settings import PolicyName


class Policy(Protocol):
    def order(self, workers: Sequence[Worker]) -> list[Worker]: ...


class RoundRobin:
    """Each call starts one worker further along; the rest follow in turn."""

    def __init__(self) -> None:
        self._calls = 0

    def order(self, workers: Sequence[Worker]) -> list[Worker]:
        if not workers:
            return []
        start = self._calls % len(workers)
        self._calls += 1
        return list(workers[start:]) + list(workers[:start])


class LeastLoaded:
    """Least work first.

    Decode servers: fewest requests (this router's in-flight ones plus the
    server's reported queue), then most free KV blocks. Prefill servers: fewest
    prompt tokens waiting (reported queue plus this router's in-flight tokens).
    Ties keep config order, so the choice is deterministic.
    """

    def order(self, workers: Sequence[Worker]) -> list[Worker]:
        return sorted(workers, key=self._load)

    @staticmethod
    def _load(w: Worker) -> tuple:
        if w.role == "prefill":
            return (w.queued_tokens + w.inflight_tokens, w.inflight)
        return (w.inflight + w.queue_depth, -w.free_blocks)


def make_policy(name: PolicyName) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"unknown router policy {name!r} (expected round_robin or least_loaded)")
