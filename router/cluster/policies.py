"""Which worker gets the next request. Pure: no I/O, no clocks.

A policy orders the healthy candidates for one prompt; the dispatcher tries
them in that order (a decode server without room answers 503 at once and the
next one is tried), so a policy never has to know about refusals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.cluster.kv_index import KvIndex
from router.cluster.registry import Worker
from router.settings import PolicyName


class Policy(Protocol):
    def order(self, workers: Sequence[Worker], prompt: Sequence[int] = ()) -> list[Worker]: ...


class RoundRobin:
    """Each call starts one worker further along; the rest follow in turn."""

    def __init__(self) -> None:
        self._calls = 0

    def order(self, workers: Sequence[Worker], prompt: Sequence[int] = ()) -> list[Worker]:
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

    def order(self, workers: Sequence[Worker], prompt: Sequence[int] = ()) -> list[Worker]:
        return sorted(workers, key=self._load)

    @staticmethod
    def _load(w: Worker) -> tuple:
        if w.role == "prefill":
            return (w.queued_tokens + w.inflight_tokens, w.inflight)
        return (w.inflight + w.queue_depth, -w.free_blocks)


class CacheAware:
    """The most cached prefix, weighed against load.

    For each candidate ``w``: ``hit = matched(w) / len(prompt)``, the share of the
    prompt the server holds (router/cluster/kv_index.py: its published block hashes), and
    ``load = inflight / max_inflight`` (this router's requests on it over its limit;
    with no limit, over the router's requests on all the candidates). Highest
    ``score = hit - load_weight * load`` first; ties: more matched, then less load,
    then config order. With the default weight of 1, a server holding the whole
    prompt keeps winning until it is nearly full while an idle one holds nothing,
    and a server holding a quarter of it loses once it carries a quarter more of
    the load: one hot prefix spreads once its server is busy, and the server that
    takes the overflow caches the prefix too.
    """

    def __init__(self, index: KvIndex, load_weight: float = 1.0) -> None:
        self.index = index
        self.load_weight = load_weight

    def order(self, workers: Sequence[Worker], prompt: Sequence[int] = ()) -> list[Worker]:
        matched = self.index.matcher(prompt)
        total = max(1, sum(w.inflight for w in workers))

        def key(item: tuple[int, Worker]) -> tuple:
            i, w = item
            tokens = matched(w.name)
            hit = tokens / len(prompt) if prompt else 0.0
            load = w.inflight / w.max_inflight if w.max_inflight else w.inflight / total
            return (-(hit - self.load_weight * load), -tokens, load, i)

        return [w for _, w in sorted(enumerate(workers), key=key)]


def make_policy(name: PolicyName, index: KvIndex | None = None, load_weight: float = 1.0) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "cache_aware":
        return CacheAware(index if index is not None else KvIndex(), load_weight)
    raise ValueError(f"unknown router policy {name!r} (expected round_robin, least_loaded or cache_aware)")
