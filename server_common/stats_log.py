"""Each process says what it is doing: a stats line every few seconds while it has traffic.

    stats d0: running 3, waiting 1; KV 12.5% used; prompt 812.0 tok/s, generation 96.0 tok/s;
              prefix-cache hits 33%; transfers 4.0/s; preemptions 0

(one line; the router's says requests/s, streams open, queued, tokens/s and workers in rotation).
A process logs one every ``interval_s`` seconds (``log_stats_interval_s`` in the cluster config; 0
turns them off) when something happened since the last (tokens computed or requests held), and
nothing while idle. Logged by ``pdserve.stats``, which ``pdserve launch`` picks out of each
process's log and shows on its terminal, prefixed with the process's name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("pdserve.stats")
LOGGER = log.name


@dataclass(frozen=True)
class ServerSnapshot:
    """What a prefill or decode server's stats line is computed from (counters are running totals)."""

    at: float  # time.monotonic()
    running: int
    waiting: int
    blocks_held: int  # reserved or running
    blocks_total: int
    prompt_tokens: int
    decode_tokens: int
    prefix_queried: int
    prefix_hits: int
    transfers: int
    preemptions: int


def server_line(name: str, before: ServerSnapshot, now: ServerSnapshot) -> str | None:
    """The line for the interval between two snapshots, or None when nothing happened in it."""
    seconds = max(now.at - before.at, 1e-9)
    prompt, decode = now.prompt_tokens - before.prompt_tokens, now.decode_tokens - before.decode_tokens
    transfers = now.transfers - before.transfers
    if not (prompt or decode or transfers or now.running or now.waiting or now.blocks_held):
        return None
    queried = now.prefix_queried - before.prefix_queried
    hits = f"{100 * (now.prefix_hits - before.prefix_hits) / queried:.0f}%" if queried else "-"
    usage = 100 * now.blocks_held / max(now.blocks_total, 1)
    return (
        f"stats {name}: running {now.running}, waiting {now.waiting}; KV {usage:.1f}% used; "
        f"prompt {prompt / seconds:.1f} tok/s, generation {decode / seconds:.1f} tok/s; prefix-cache hits {hits}; "
        f"transfers {transfers / seconds:.1f}/s; preemptions {now.preemptions - before.preemptions}"
    )


@dataclass(frozen=True)
class RouterSnapshot:
    at: float
    requests: int  # answered, any status
    open_streams: int
    queued: int
    prompt_tokens: int
    completion_tokens: int
    in_rotation: int
    workers: int


def router_line(before: RouterSnapshot, now: RouterSnapshot) -> str | None:
    seconds = max(now.at - before.at, 1e-9)
    requests = now.requests - before.requests
    if not (requests or now.open_streams or now.queued):
        return None
    return (
        f"stats router: requests {requests / seconds:.1f}/s, streams open {now.open_streams}, queued "
        f"{now.queued}; prompt {(now.prompt_tokens - before.prompt_tokens) / seconds:.1f} tok/s, generation "
        f"{(now.completion_tokens - before.completion_tokens) / seconds:.1f} tok/s; workers in rotation "
        f"{now.in_rotation}/{now.workers}"
    )


async def log_stats(
    snapshot: Callable[[], object], line: Callable[[object, object], str | None], interval_s: float
) -> None:
    """Every ``interval_s``: the line between the last snapshot and now, when there is one (runs until cancelled)."""
    before = snapshot()
    while True:
        await asyncio.sleep(interval_s)
        now = snapshot()
        text = line(before, now)
        if text is not None:
            log.info("%s", text)
        before = now


def server_snapshot(service) -> ServerSnapshot:
    """A prefill or decode service's numbers now (its engine thread's last stats and its metrics)."""
    stats = service.engine_thread.stats
    s, c = stats.scheduler, stats.counters
    transfers = service.metrics.registry.get_sample_value("pdserve_transfer_seconds_count") or 0
    return ServerSnapshot(
        time.monotonic(),
        s.num_running,
        s.queue_depth,
        s.reserved + s.running,
        s.total,
        c.prompt_tokens,
        c.decode_tokens,
        c.prefix_queries_tokens,
        c.prefix_hits_tokens,
        int(transfers),
        c.preemptions,
    )
