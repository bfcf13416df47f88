"""The cluster-shared tier: blocks in a Redis server that every prefill and decode server reads.

Why Redis: the Debian package (``redis-server``) runs here and in CI with no
cluster to set up, one server holds bytes by key with its own byte limit and
LRU eviction (``maxmemory`` with ``maxmemory-policy allkeys-lru``: the store's
limit is the server's, set where the server is started), and every process
reaches it with one small client (redis-py). Mooncake Store would move bytes
over RDMA without a copy through a server, but its package needs its transfer
engine and metadata service, which do not run here.

A block is one key, ``pdserve:kv:<layout fingerprint>:<hash as 16 hex digits>``,
whose value is the disk tier's format (engine/tiers/disk.py: a header with the
payload's CRC32 and length, then the payload), so a value cut short or changed
is a miss counted as corrupt and deleted, never served. Several servers write
the same hash with the same bytes; ``SET NX`` keeps the first.

Every call has a short socket timeout. A call that fails (the store down, slow,
refusing) is a miss or a dropped write, counted in ``errors``, and the tier
answers "absent" without asking for ``retry_s``, so a store that is down costs
a request one timeout at most, not one per block. The engine never waits on a
write: writes go through the same bounded queue and thread as the other tiers.
What the store holds (``entries``, ``bytes_held``) is the server's to say (its
``INFO memory``); this client reports the counts it saw.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence

import redis
import torch

from engine.tiers.disk import HEADER, MAGIC
from engine.tiers.tier import TierStats, Writes, block_checksum

log = logging.getLogger(__name__)
COUNTERS = ("hits", "misses", "corrupt", "bytes_read", "bytes_written", "dropped_writes", "errors")


class RedisTier:
    name = "redis"
    shared = True

    def __init__(
        self, url: str, namespace: str, queue_blocks: int = 256, timeout_s: float = 0.2, retry_s: float = 2.0
    ) -> None:
        self.prefix = f"pdserve:kv:{namespace}:"
        self.retry_s = retry_s
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._down_until = 0.0
        self._writes = Writes(self.name, queue_blocks, self._store, lambda: self._bump("dropped_writes"))
        self._writes.start()

    def key(self, h: int) -> str:
        return f"{self.prefix}{h:016x}"

    # ---- the interface (engine/tiers/kv.py) ------------------------------------------
    def put(self, h: int, data: torch.Tensor, checksum: int | None = None) -> bool:
        """Queue block ``h`` for the store; False (counted) when the queue is full or the tier closed."""
        return self._writes.offer(h, data, checksum)

    def held(self, hashes: Sequence[int]) -> list[bool]:
        """Whether the store holds each of ``hashes`` (one round trip); all False while it is down."""
        if not hashes or self._down():
            return [False] * len(hashes)
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            return [bool(n) for n in pipe.execute()]
        except redis.RedisError as exc:
            self._failed(exc)
            return [False] * len(hashes)

    def contains(self, h: int) -> bool:
        return self.held([h])[0]

    def get(self, h: int) -> torch.Tensor | None:
        """Block ``h``'s bytes if the store holds it intact; None (a miss) otherwise."""
        raw = None
        if not self._down():
            try:
                raw = self._client.get(self.key(h))
            except redis.RedisError as exc:
                self._failed(exc)
        if raw is None:
            self._bump("misses")
            return None
        data = _payload(raw)
        if data is None:
            self._bump("corrupt")
            self._bump("misses")
            self._delete(h)
            return None
        with self._lock:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += data.numel()
        return data

    def drain(self, timeout_s: float = 30.0) -> bool:
        return self._writes.drain(timeout_s)

    def close(self) -> None:
        if self._writes.closed:
            return
        self._writes.close()
        self._client.close()

    def stats(self) -> TierStats:
        with self._lock:
            counts = {k: v for k, v in self._counts.items() if k != "errors"}
            return TierStats(self.name, **counts, errors=self._counts["errors"])

    # ---- helpers -------------------------------------------------------------------
    def _store(self, h: int, data: torch.Tensor, checksum: int | None) -> None:
        if self._down():
            self._bump("dropped_writes")
            return
        crc = block_checksum(data) if checksum is None else checksum
        value = HEADER.pack(MAGIC, crc, 0, data.numel()) + data.numpy().tobytes()
        try:
            self._client.set(self.key(h), value, nx=True)
        except redis.RedisError as exc:
            self._failed(exc)
            self._bump("dropped_writes")
            return
        with self._lock:
            self._counts["bytes_written"] += len(value)

    def _delete(self, h: int) -> None:
        try:
            self._client.delete(self.key(h))
        except redis.RedisError as exc:
            self._failed(exc)

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, exc: Exception) -> None:
        """The store did not answer: count it, and ask nothing for ``retry_s``."""
        with self._lock:
            self._counts["errors"] += 1
            first = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.retry_s
        if first:
            log.warning("KV tier redis: %s; treated as empty for %.1f s", exc, self.retry_s)

    def _bump(self, counter: str) -> None:
        with self._lock:
            self._counts[counter] += 1


def _payload(raw: bytes) -> torch.Tensor | None:
    """A stored value's payload when its header, length and CRC32 hold; None when not."""
    if len(raw) <= HEADER.size:
        return None
    try:
        magic, checksum, _, length = HEADER.unpack_from(raw)
    except struct.error:
        return None
    if magic != MAGIC or len(raw) - HEADER.size != length:
        return None
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=HEADER.size)
    return data if block_checksum(data) == checksum else None
