"""What a server's block manager stored and evicted, for the router's cache index.

Pure Python and thread-safe (the engine thread appends, the HTTP event loop
reads). Every full block that becomes findable by hash is a ``stored`` event,
every hash dropped to make room an ``evicted`` one; a block one of the
server's own lower tiers (engine/tiers/: host, disk) now holds is ``tiered``,
one none of them holds any more ``untiered``; events are numbered from 1
in the order they happened and the last ``capacity`` are kept. ``epoch`` is
drawn when the log is made, so a restarted server has a new one. A reader
that asks for the events after the seq it has seen learns ``oldest``, the
first seq still held: if that is past the one it needs, events were lost and
it takes ``snapshot()`` (every hash held now, with the seq it is current at).
The router's side: router/cluster/kv_index.py.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

STORED = "stored"
EVICTED = "evicted"
TIERED = "tiered"  # the block can be loaded from one of this server's own lower tiers (engine/tiers/)
UNTIERED = "untiered"  # it no longer can


@dataclass(frozen=True)
class KvEventPage:
    epoch: str
    oldest: int  # seq of the oldest event still held (last + 1 when none is)
    last: int  # seq of the newest event (0: none yet)
    events: list[tuple[int, str, int]]  # (seq, STORED | EVICTED, block hash), seq ascending


@dataclass(frozen=True)
class KvSnapshot:
    epoch: str
    seq: int  # the hashes are those held after event ``seq``
    hashes: list[int]
    tiered: list[int]  # those its own lower tiers hold


class KvEventLog:
    def __init__(self, capacity: int = 65536, epoch: str | None = None) -> None:
        assert capacity > 0
        self.epoch = epoch or secrets.token_hex(8)
        self._lock = threading.Lock()
        self._ring: deque[tuple[int, str, int]] = deque(maxlen=capacity)
        self._seq = 0
        self._held: set[int] = set()
        self._tiered: set[int] = set()
        self._listeners: list[Callable[[], None]] = []

    def listen(self, callback: Callable[[], None]) -> None:
        """``callback()`` after each event is added, on the adding thread (it must be quick and thread-safe)."""
        self._listeners.append(callback)

    def stored(self, block_hash: int) -> None:
        self._add(STORED, block_hash)

    def evicted(self, block_hash: int) -> None:
        self._add(EVICTED, block_hash)

    def tiered(self, block_hash: int) -> None:
        self._add(TIERED, block_hash)

    def untiered(self, block_hash: int) -> None:
        self._add(UNTIERED, block_hash)

    def _add(self, kind: str, block_hash: int) -> None:
        with self._lock:
            self._seq += 1
            self._ring.append((self._seq, kind, block_hash))
            if kind == STORED:
                self._held.add(block_hash)
            elif kind == EVICTED:
                self._held.discard(block_hash)
            elif kind == TIERED:
                self._tiered.add(block_hash)
            else:
                self._tiered.discard(block_hash)
        for callback in self._listeners:
            callback()

    def since(self, after: int, limit: int = 4096) -> KvEventPage:
        """Up to ``limit`` events with seq > ``after``, oldest first."""
        with self._lock:
            oldest = self._ring[0][0] if self._ring else self._seq + 1
            start = max(after + 1, oldest)
            skip = start - oldest
            events = (
                [self._ring[i] for i in range(skip, min(len(self._ring), skip + limit))] if start <= self._seq else []
            )
            return KvEventPage(self.epoch, oldest, self._seq, events)

    def held_run(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a chain, first first), in a run from the first, the cache or this server's
        own tiers hold now. From any thread; a hint only: the engine may evict any of them at its next step."""
        with self._lock:
            for n, h in enumerate(hashes):
                if h not in self._held and h not in self._tiered:
                    return n
            return len(hashes)

    def snapshot(self) -> KvSnapshot:
        with self._lock:
            return KvSnapshot(self.epoch, self._seq, sorted(self._held), sorted(self._tiered))
