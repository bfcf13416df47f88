"""One KV tier: a byte-bounded, LRU store of whole blocks keyed by their chain hash, written by a thread.

Every tier (host memory, local disk) is this class with three storage methods.
``put`` never blocks its caller: it hands the block to the tier's writer thread
through a bounded queue and, when the queue is full, drops the write and counts
it, so an engine step never waits for a tier. ``get`` runs on the caller's
thread (the engine's, at admission) and serves a block only when its bytes
still match the CRC32 it was written with::

    engine thread                      writer thread
    put(h, data) --queue (bounded)-->  checksum, _persist (outside the lock),
      full: dropped_writes += 1        index h, evict oldest past max_bytes
    get(h): index? _fetch, CRC32 ok?  -> data (hit)
            absent -> miss; bad bytes, truncated or missing file -> corrupt + miss, entry dropped

The lock guards the index and every ``_fetch``/``_discard``: a block is never
read while the writer removes it. A block larger than ``max_bytes`` is never
stored (counted as a dropped write).
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


def block_checksum(data: torch.Tensor) -> int:
    """CRC32 of a block's bytes (a flat uint8 CPU tensor): the checksum the transfer path uses
    (transfer/integrity.py ``kv_checksum``), over the whole block."""
    return zlib.crc32(data.numpy())


@dataclass(frozen=True)
class TenantShare:
    """One tenant's part of a shared store held to per-tenant shares (engine/tiers/redis_store.py): the bytes
    the store counts for it now (every server's writes), and what this server's writes for it were refused or
    evicted of its own blocks to stay within ``share``."""

    tenant: str
    bytes_held: int = 0
    share: int = 0
    refused_writes: int = 0  # a block over the share, or the store out of memory
    evictions: int = 0  # its own oldest blocks dropped to make room for its new ones


@dataclass(frozen=True)
class TierStats:
    """A tier's counters since it opened, and what it holds now."""

    name: str
    hits: int = 0  # blocks served
    misses: int = 0  # blocks asked for and not served (absent or corrupt)
    corrupt: int = 0  # entries whose bytes did not match their checksum, or whose file was truncated or gone
    bytes_read: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0  # writes refused: queue full, block over the limit, or the store failed
    evictions: int = 0  # entries dropped to stay within max_bytes
    entries: int = 0
    bytes_held: int = 0
    max_bytes: int = 0
    errors: int = 0  # calls to a store that failed (down, slow): engine/tiers/redis_store.py
    tenants: tuple[TenantShare, ...] = ()  # the shared store's tenants, when it holds each to a share


class Store(Protocol):
    """What engine/tiers/kv.py asks of a tier: this module's ``Tier`` and the shared Redis store."""

    name: str
    shared: bool  # read by other servers: a block is published when its last owner frees it, not on eviction

    def put(self, h: int, data: torch.Tensor, checksum: int | None = None, tenant: str | None = None) -> bool: ...

    def held(self, hashes: Sequence[int]) -> list[bool]: ...

    def get(self, h: int) -> torch.Tensor | None: ...

    def drain(self, timeout_s: float = 30.0) -> bool: ...

    def close(self) -> None: ...

    def stats(self) -> TierStats: ...


_STOP = object()
log = logging.getLogger(__name__)


class Writes:
    """A bounded queue of block writes and the thread that runs ``store(h, data, checksum, tenant)`` for each, in
    order: a full queue (or a closed one) drops the write, counted by ``dropped()``, so that nobody ever
    waits for a tier; a write that raises is logged and counted the same way, and the tier goes on."""

    def __init__(
        self,
        name: str,
        queue_blocks: int,
        store: Callable[[int, torch.Tensor, int | None, str | None], None],
        dropped: Callable[[], None],
    ) -> None:
        self._name = name
        self._store, self._dropped = store, dropped
        self._queue: queue.Queue = queue.Queue(maxsize=queue_blocks)
        self._thread = threading.Thread(target=self._loop, name=f"kv-tier-{name}", daemon=True)
        self.closed = False

    def start(self) -> None:
        self._thread.start()

    def offer(self, h: int, data: torch.Tensor, checksum: int | None, tenant: str | None = None) -> bool:
        """Queue one write; False (counted) when it was dropped."""
        if self.closed:
            return False
        try:
            self._queue.put_nowait((h, data, checksum, tenant))
        except queue.Full:
            self._dropped()
            return False
        return True

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued write is stored; False on timeout."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: not self._queue.unfinished_tasks, timeout_s)

    def close(self) -> None:
        """Stop the thread after the queued writes; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._store(*item)
            except Exception:  # a write that failed is a write dropped; the tier goes on
                log.exception("KV tier %s: a block's write failed", self._name)
                self._dropped()
            finally:
                self._queue.task_done()


class Tier(ABC):
    """Byte-bounded LRU of blocks by hash; subclasses say how an entry is stored, read and removed."""

    name = "tier"
    shared = False

    def __init__(self, max_bytes: int, queue_blocks: int) -> None:
        assert max_bytes > 0 and queue_blocks > 0
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> bytes held, oldest first
        self._held = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "bytes_read", "bytes_written", "dropped_writes", "evictions"), 0
        )
        self._writes = Writes(self.name, queue_blocks, self._store, lambda: self._bump("dropped_writes"))
        # Called with (hash, True) when an entry is listed, (hash, False) when dropped, under the lock.
        self.on_change: Callable[[int, bool], None] | None = None

    def start(self) -> None:
        """Start the writer thread (after the subclass has read what it already holds)."""
        self._writes.start()

    # ---- storage, in subclasses ------------------------------------------------
    @abstractmethod
    def _persist(self, h: int, data: torch.Tensor, checksum: int) -> int:
        """Store one block (writer thread, outside the lock); the bytes it now holds. Raises OSError on failure."""

    @abstractmethod
    def _fetch(self, h: int) -> tuple[torch.Tensor, int] | None:
        """(data, checksum it was written with) of an indexed block, under the lock; None when it is
        unreadable (truncated, missing)."""

    @abstractmethod
    def _discard(self, h: int) -> None:
        """Remove one block's storage, under the lock."""

    # ---- the interface -------------------------------------------------------------
    def put(self, h: int, data: torch.Tensor, checksum: int | None = None, tenant: str | None = None) -> bool:
        """Queue block ``h`` (a flat uint8 CPU tensor nobody writes again) for storing; ``checksum``: its
        CRC32, computed on the writer thread when None. A block held already is only marked recently used.
        False when the write was dropped (queue full, closed). ``tenant`` counts only in a shared store."""
        with self._lock:
            if h in self._index:
                self._index.move_to_end(h)
                return True
        return self._writes.offer(h, data, checksum)

    def contains(self, h: int) -> bool:
        """Whether the tier lists block ``h`` (it may still turn out corrupt); counts nothing."""
        with self._lock:
            return h in self._index

    def held(self, hashes: Sequence[int]) -> list[bool]:
        """``contains`` of each of ``hashes``."""
        with self._lock:
            return [h in self._index for h in hashes]

    def get(self, h: int) -> torch.Tensor | None:
        """Block ``h``'s bytes if held and intact (a hit); None otherwise (a miss). A corrupt entry is
        dropped and counted."""
        with self._lock:
            if h not in self._index:
                self._counts["misses"] += 1
                return None
            found = self._fetch(h)
            if found is None or block_checksum(found[0]) != found[1]:
                self._counts["corrupt"] += 1
                self._counts["misses"] += 1
                self._forget(h)
                return None
            self._index.move_to_end(h)
            self._counts["hits"] += 1
            self._counts["bytes_read"] += found[0].numel()
            return found[0]

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is stored (tests, benchmarks, shutdown); False on timeout."""
        return self._writes.drain(timeout_s)

    def close(self) -> None:
        """Stop the writer after the queued writes; idempotent."""
        self._writes.close()

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                self.name, **self._counts, entries=len(self._index), bytes_held=self._held, max_bytes=self.max_bytes
            )

    # ---- helpers -------------------------------------------------------------------
    def _store(self, h: int, data: torch.Tensor, checksum: int | None, tenant: str | None) -> None:
        if data.numel() > self.max_bytes:
            self._bump("dropped_writes")
            return
        with self._lock:
            if h in self._index:
                return
        try:
            held = self._persist(h, data, block_checksum(data) if checksum is None else checksum)
        except OSError:
            self._bump("dropped_writes")
            return
        with self._lock:
            self._index[h] = held
            self._held += held
            self._counts["bytes_written"] += held
            self._changed(h, True)
            while self._held > self.max_bytes:
                oldest = next(iter(self._index))
                self._forget(oldest)
                self._counts["evictions"] += 1

    def _index_existing(self, h: int, held: int) -> None:
        """List a block found in storage at start (oldest first); trims to max_bytes."""
        self._index[h] = held
        self._held += held
        while self._held > self.max_bytes:
            self._forget(next(iter(self._index)))

    def _forget(self, h: int) -> None:
        """Drop an entry and its storage (lock held)."""
        self._held -= self._index.pop(h)
        self._discard(h)
        self._changed(h, False)

    def _changed(self, h: int, held: bool) -> None:
        if self.on_change is not None:
            self.on_change(h, held)

    def listed(self) -> list[int]:
        """Every hash the tier lists now."""
        with self._lock:
            return list(self._index)

    def _bump(self, counter: str) -> None:
        with self._lock:
            self._counts[counter] += 1
