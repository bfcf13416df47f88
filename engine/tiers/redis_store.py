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

With ``share_bytes`` (``redis_max_bytes_per_tenant``), each tenant's blocks
are counted and bounded on the Redis server itself (engine/tiers/redis_shares.py):
a tenant past its share loses its own oldest blocks, never another's.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence

import redis
import torch

from engine.request import DEFAULT_TENANT
from engine.tiers import redis_shares
from engine.tiers.disk import HEADER, MAGIC
from engine.tiers.tier import TenantShare, TierStats, Writes, block_checksum

log = logging.getLogger(__name__)
COUNTERS = ("hits", "misses", "corrupt", "bytes_read", "bytes_written", "dropped_writes", "evictions", "errors")


class RedisTier:
    name = "redis"
    shared = True

    def __init__(
        self,
        url: str,
        namespace: str,
        queue_blocks: int = 256,
        timeout_s: float = 0.2,
        retry_s: float = 2.0,
        share_bytes: int | None = None,
        tenants: frozenset[str] = frozenset(),
    ) -> None:
        """``share_bytes``: each tenant's share (None: no shares); ``tenants``: the names the shares keep
        apart, any other charged to the default tenant (empty: every name)."""
        assert share_bytes is None or share_bytes > 0
        self.prefix = f"pdserve:kv:{namespace}:"
        self.meta = f"pdserve:kvshare:{namespace}:"  # the per-tenant accounts (engine/tiers/redis_shares.py)
        self.share_bytes = share_bytes
        self.tenants = tenants
        self.retry_s = retry_s
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._down_until = 0.0
        # Per tenant: bytes the store counted at this server's last write, and this server's refused writes
        # and evictions for it. Only tenants that wrote through this server appear.
        self._tenants: dict[str, dict[str, int]] = {}
        self._write_script = self._client.register_script(redis_shares.WRITE)
        self._touch_script = self._client.register_script(redis_shares.TOUCH)
        self._drop_script = self._client.register_script(redis_shares.DROP)
        if share_bytes is not None:
            self._check_policy()
        self._writes = Writes(self.name, queue_blocks, self._store, lambda: self._bump("dropped_writes"))
        self._writes.start()

    def key(self, h: int) -> str:
        return f"{self.prefix}{h:016x}"

    # ---- the interface (engine/tiers/kv.py) ------------------------------------------
    def put(self, h: int, data: torch.Tensor, checksum: int | None = None, tenant: str | None = None) -> bool:
        """Queue block ``h`` for the store, charged to ``tenant`` (None: the default tenant) when the store
        holds tenants to shares; False (counted) when the queue is full or the tier closed."""
        return self._writes.offer(h, data, checksum, tenant)

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
                raw = self._read(h)
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
        """This client's counts; with shares, each tenant's bytes as the store counted them at this server's
        last write (no call to the store: the engine thread asks for this every round)."""
        with self._lock:
            counts = {k: v for k, v in self._counts.items() if k != "errors"}
            share = self.share_bytes or 0
            tenants = tuple(TenantShare(t, **c, share=share) for t, c in sorted(self._tenants.items()))
            return TierStats(self.name, **counts, errors=self._counts["errors"], tenants=tenants)

    def tenant_bytes(self) -> dict[str, int]:
        """Each tenant's bytes, as the store counts them now (one call; tests, tools)."""
        raw = self._client.hgetall(self.meta + "bytes")
        return {k.decode(): int(v) for k, v in raw.items()}

    # ---- helpers -------------------------------------------------------------------
    def _store(self, h: int, data: torch.Tensor, checksum: int | None, tenant: str | None) -> None:
        if self._down():
            self._bump("dropped_writes")
            return
        crc = block_checksum(data) if checksum is None else checksum
        value = HEADER.pack(MAGIC, crc, 0, data.numel()) + data.numpy().tobytes()
        if self.share_bytes is not None:
            self._store_shared(h, value, self._account(tenant))
            return
        try:
            self._client.set(self.key(h), value, nx=True)
        except redis.RedisError as exc:
            self._failed(exc)
            self._bump("dropped_writes")
            return
        with self._lock:
            self._counts["bytes_written"] += len(value)

    def _store_shared(self, h: int, value: bytes, tenant: str) -> None:
        """Write one block charged to ``tenant`` within its share (the ``WRITE`` script)."""
        assert self.share_bytes is not None
        if not redis_shares.safe_tenant(tenant):
            log.warning("KV tier redis: a write for tenant %r refused: not a tenant's name", tenant[:80])
            self._bump("dropped_writes")
            return
        args = [self.meta, self.prefix, f"{h:016x}", value, tenant, self.share_bytes]
        try:
            outcome, evicted, *flat = self._write_script(keys=[self.key(h)], args=args)
        except redis.OutOfMemoryError:
            outcome, evicted, flat = -1, 0, []  # the store is full (maxmemory, noeviction): refused, not down
        except redis.RedisError as exc:
            self._failed(exc)
            self._bump("dropped_writes")
            return
        with self._lock:
            mine = self._tenants.setdefault(tenant, {"bytes_held": 0, "refused_writes": 0, "evictions": 0})
            mine["evictions"] += evicted
            self._counts["evictions"] += evicted
            if outcome == -1:
                mine["refused_writes"] += 1
                self._counts["dropped_writes"] += 1
            elif outcome == 1:
                self._counts["bytes_written"] += len(value)
            if flat:
                held = redis_shares.accounts(flat)
                for name, counts in self._tenants.items():
                    counts["bytes_held"] = held.get(name, 0)

    def _account(self, tenant: str | None) -> str:
        """Whose share a block for ``tenant`` is charged to: its own when it is one of ``tenants`` (or any
        name, when none are listed); the default tenant's otherwise."""
        if tenant is None or (self.tenants and tenant not in self.tenants):
            return DEFAULT_TENANT
        return tenant

    def _read(self, h: int) -> bytes | None:
        """Block ``h``'s stored value; with shares, the read also refreshes its place in its owner's LRU (or
        unlists it when its key is gone), in the same round trip."""
        if self.share_bytes is None:
            return self._client.get(self.key(h))
        key, args = self.key(h), [self.meta, f"{h:016x}"]
        pipe = self._client.pipeline(transaction=False)
        pipe.get(key)
        # By its digest: a script handed to the pipeline itself would cost a SCRIPT EXISTS round trip per read.
        pipe.evalsha(self._touch_script.sha, 1, key, *args)
        raw, touched = pipe.execute(raise_on_error=False)
        if isinstance(raw, Exception):
            raise raw
        if isinstance(touched, redis.exceptions.NoScriptError):  # the store restarted since: load it, run it
            self._touch_script(keys=[key], args=args)
        elif isinstance(touched, Exception):
            raise touched
        return raw

    def _delete(self, h: int) -> None:
        try:
            if self.share_bytes is None:
                self._client.delete(self.key(h))
            else:
                self._drop_script(keys=[self.key(h)], args=[self.meta, f"{h:016x}"])
        except redis.RedisError as exc:
            self._failed(exc)

    def _check_policy(self) -> None:
        """Warn when the Redis server may evict keys on its own: the accounts may be among them."""
        try:
            policy = self._client.config_get("maxmemory-policy").get("maxmemory-policy", "")
        except redis.RedisError:
            return  # CONFIG may be disabled (managed Redis); the docs say what to set
        if policy.startswith("allkeys"):
            log.warning(
                "KV tier redis: maxmemory-policy is %s; with per-tenant shares use noeviction or volatile-lru, "
                "or Redis may evict the shares' accounts",
                policy,
            )

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
