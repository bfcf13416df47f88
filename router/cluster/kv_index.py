"""The router's view of which block hashes each server holds. Pure: no I/O.

Each server publishes a numbered log of the hashes it stores and evicts
(engine/kv_events.py, ``GET /kv/events``); ``router.cluster.kv_events`` polls it and
feeds this index. One ``WorkerKvIndex`` per server keeps the server's epoch,
the last seq applied and the set of hashes. A page whose epoch differs (the
server restarted) or whose oldest event is past the next one needed (events
were lost: the server's ring wrapped) is not applied: the index is marked
stale, holds nothing until a snapshot (``GET /kv/blocks``) is loaded, and the
poller loads one. So a lost event costs at most one poll of routing with no
cache knowledge for that server, never a wrong claim that lasts.

A prompt is hashed as the server hashes it (``engine.prefix_cache.chain_hashes``,
with that server's block size and salt); its matched prefix on a server is
the run of leading hashes the server holds, in tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.prefix_cache import chain_hashes
from wire.replies import KvBlocksReply, KvEventsReply


@dataclass
class WorkerKvIndex:
    epoch: str | None = None  # None: nothing loaded yet, or stale (a snapshot is needed)
    seq: int = 0  # the last event applied
    hashes: set[int] = field(default_factory=set)
    tiered: set[int] = field(default_factory=set)  # held by the server's own lower tiers (host, disk)
    block_size: int = 0
    salt: str = ""
    resyncs: int = 0  # snapshots loaded

    @property
    def stale(self) -> bool:
        return self.epoch is None

    def apply(self, page: KvEventsReply) -> bool:
        """Apply the events after ``seq``; False (and the index emptied) when a snapshot is needed."""
        if self.stale or page.epoch != self.epoch or page.oldest > self.seq + 1 or page.last < self.seq:
            self.invalidate()
            return False
        for seq, kind, h in page.events:
            if seq <= self.seq:
                continue
            if seq != self.seq + 1:  # a hole inside the page: never applied past it
                self.invalidate()
                return False
            if kind == "stored":
                self.hashes.add(h)
            elif kind == "evicted":
                self.hashes.discard(h)
            elif kind == "tiered":
                self.tiered.add(h)
            else:
                self.tiered.discard(h)
            self.seq = seq
        return True

    def load(self, snapshot: KvBlocksReply) -> None:
        self.epoch, self.seq, self.hashes = snapshot.epoch, snapshot.seq, set(snapshot.hashes)
        self.tiered = set(snapshot.tiered)
        self.block_size, self.salt = snapshot.block_size, snapshot.salt
        self.resyncs += 1

    def invalidate(self) -> None:
        self.epoch, self.seq, self.hashes, self.tiered = None, 0, set(), set()

    def matched_tokens(self, hashes: Sequence[int]) -> int:
        """Tokens of the longest run of leading ``hashes`` this server would not compute: held in its
        cache, then (as its engine continues the chain, engine/tiers/kv.py) in its cache or its own
        lower tiers. A tier's block counts as held: loading one costs under 3 % of computing it on a
        CPU (bench.micro.kv_tiers: 33x to 190x faster), so it is what the server would not compute."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        for h in hashes[n:]:
            if h not in self.tiered and h not in self.hashes:
                break
            n += 1
        return n * self.block_size


class KvIndex:
    """Every server's ``WorkerKvIndex``, by worker name."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerKvIndex] = {}

    def of(self, name: str) -> WorkerKvIndex:
        return self.workers.setdefault(name, WorkerKvIndex())

    def forget(self, name: str) -> None:
        self.workers.pop(name, None)

    def matcher(self, prompt: Sequence[int]) -> Callable[[str], int]:
        """``matched(name) -> tokens`` for one prompt, hashing it once per (block size, salt)."""
        chains: dict[tuple[int, str], list[int]] = {}

        def matched(name: str) -> int:
            idx = self.workers.get(name)
            if idx is None or idx.stale or not (idx.hashes or idx.tiered) or idx.block_size <= 0:
                return 0
            key = (idx.block_size, idx.salt)
            if key not in chains:
                # The engine never reuses the block holding the last token: hash only the blocks before it.
                chains[key] = chain_hashes(idx.salt, prompt[: max(0, len(prompt) - 1)], idx.block_size)
            return idx.matched_tokens(chains[key])

        return matched
