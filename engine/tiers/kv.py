"""KV tiers of one engine: evicted blocks written down, a prefix's next blocks read back up.

The engine's block manager calls ``evicted`` when it drops a cached block's hash
to reuse the block (engine/block_manager.py ``on_evict``): the block's K/V, every
layer, is copied out of the paged cache at once (before anything overwrites it)
and handed to every tier (write-through; each tier writes on its own thread).
At admission the scheduler asks how many of a request's next hashes, past the
blocks found in the engine's own cache, some tier lists (``available``), takes
fresh blocks for them and ``load``s them, tier by tier in order (host, disk,
then the shared Redis store); a block no tier serves intact ends the run, and
the rest is computed::

    request's chain:  h0 h1 h2 | h3 h4 | h5 h6
                      engine    tiers    computed
                      (take)    (load into fresh blocks, then registered as computed)

A shared tier (the Redis store, read by other servers) is written sooner:
when a block's last owner frees it (``on_cached``: its K/V final, the block
still findable here), so that the next turn of a conversation finds it on any
server whose blocks match (same model, dtype, block size and order), the
generated tokens' blocks included. Each hash is published once per
``PUBLISHED`` distinct hashes (a prefix every request shares is not copied
again at every request's end); an eviction writes only to the tiers of this
server then.

A block's bytes are the cache's ``kv[:, :, block]`` as stored, [layers, K|V,
slots and heads in the cache's order, width]: K and V planes alike, latents
of an MLA model (engine/mla.py) too, so every layout round-trips. One
rank's cache only: an engine split over ranks has no tiers (engine/config.py
refuses the combination). A block is written only when every layer holds
all its slots (``Block.window_from`` 0), so a sliding-window prompt whose
window layers came partly from a prefill server is never tiered.

The disk tier's folder is named by :func:`layout_fingerprint`, so files
written under another model, dtype, block size or order are never read.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import KvTiersConfig
from engine.kv_cache import KVCache
from engine.kv_events import KvEventLog
from engine.tiers.disk import DiskTier
from engine.tiers.host import HostTier
from engine.tiers.tier import Store, Tier, TierStats


def layout_fingerprint(cache: KVCache, salt: str, model_dir: str, portable: bool = False) -> str:
    """16 hex digits naming everything that makes two caches' block bytes differ: the salt (model path,
    dtype), one block's shape and order, and the model folder's files (names, sizes, and modification times;
    ``portable``: its config.json's bytes instead of the times, so that servers on other machines with the
    same model agree: the shared store's namespace)."""
    folder = Path(model_dir)
    files = sorted(
        (p.name, p.stat().st_size, 0 if portable else p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()
    )
    config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest() if portable else ""
    shape = tuple(cache.kv[:, :, 0].shape)
    text = f"{salt}|{cache.order}|{cache.dtype}|{shape}|{files}|{config}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


PUBLISHED = 1 << 16  # hashes a server remembers having published to its shared tiers


def announce(tiers: Sequence[Store], log: KvEventLog) -> None:
    """Tell ``log`` (the server's block events, for the router's cache index) which blocks ``tiers``
    (this server's own) hold: ``tiered`` when the first of them lists one, ``untiered`` when the last
    drops it. The shared store is not among them: every server reads it, so it says nothing of one."""
    lock, count = threading.Lock(), Counter[int]()

    def changed(h: int, held: bool) -> None:
        with lock:
            count[h] += 1 if held else -1
            if held and count[h] == 1:
                log.tiered(h)
            elif not held and count[h] <= 0:
                del count[h]
                log.untiered(h)

    for tier in tiers:
        if isinstance(tier, Tier):
            tier.on_change = changed
            for h in tier.listed():  # what a disk tier found at start
                changed(h, True)


class KvTiers:
    def __init__(self, cache: KVCache, tiers: Sequence[Store]) -> None:
        assert tiers, "no tier"
        self.cache = cache
        self.tiers = tuple(tiers)
        self.local = tuple(t for t in self.tiers if not t.shared)
        self.shared = tuple(t for t in self.tiers if t.shared)
        self._published: OrderedDict[int, None] = OrderedDict()  # hashes queued to the shared tiers, oldest first
        self.block_shape = tuple(cache.kv[:, :, 0].shape)
        self.block_nbytes = cache.kv[:, :, 0].numel() * cache.kv.element_size()

    @classmethod
    def open(cls, config: KvTiersConfig, cache: KVCache, salt: str, model_dir: str) -> KvTiers:
        """The tiers ``config`` names, nearest first: host, disk (in ``disk_path/<layout fingerprint>``),
        the shared Redis store (keys under the portable fingerprint)."""
        tiers: list[Store] = []
        if config.host_bytes is not None:
            tiers.append(HostTier(config.host_bytes, config.queue_blocks))
        if config.disk_path is not None and config.disk_bytes is not None:
            folder = Path(config.disk_path) / layout_fingerprint(cache, salt, model_dir)
            tiers.append(DiskTier(folder, config.disk_bytes, config.queue_blocks))
        if config.redis_url is not None:
            from engine.tiers.redis_store import RedisTier  # redis-py, only where a store is configured

            namespace = layout_fingerprint(cache, salt, model_dir, portable=True)
            tiers.append(
                RedisTier(
                    config.redis_url,
                    namespace,
                    config.queue_blocks,
                    config.redis_timeout_s,
                    share_bytes=config.redis_max_bytes_per_tenant,
                    tenants=frozenset(config.redis_tenants),
                )
            )
        return cls(cache, tiers)

    def watch(self, log: KvEventLog) -> None:
        """Tell ``log`` which blocks this server's own tiers hold (``announce``)."""
        announce(self.local, log)

    def evicted(self, block_id: int, h: int, tenant: str | None = None) -> None:
        """Block ``block_id`` (hash ``h``) is about to be reused: copy its K/V out and queue it to every tier
        (a shared one only if it was not published already, charged to ``tenant``: the tenant of the request
        that computed it here)."""
        publish = self.shared and h not in self._published
        if not self.local and not publish:
            return
        data = self._copy(block_id)
        for tier in self.local:
            tier.put(h, data)
        if publish:
            self._publish(h, data, tenant)

    def released(self, block_id: int, h: int, tenant: str | None = None) -> None:
        """Block ``block_id`` (hash ``h``) lost its last owner: publish it to the shared tiers, once, charged
        to ``tenant``."""
        if self.shared and h not in self._published:
            self._publish(h, self._copy(block_id), tenant)

    def available(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a chain, first first) some tier lists, in a run from the first."""
        if not hashes:
            return 0
        listed = [any(held) for held in zip(*(tier.held(hashes) for tier in self.tiers))]
        return listed.index(False) if False in listed else len(listed)

    def load(self, hashes: Sequence[int], block_ids: Sequence[int]) -> int:
        """Copy blocks ``hashes`` into cache blocks ``block_ids`` (every layer), first first, until one
        no tier serves intact; how many were copied."""
        for n, (h, block_id) in enumerate(zip(hashes, block_ids)):
            data = self._read(h)
            if data is None:
                return n
            self.cache.kv[:, :, block_id].copy_(data.view(self.cache.dtype).view(self.block_shape))
        return len(hashes)

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(tier.stats() for tier in self.tiers)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every tier stored its queued writes; False on timeout."""
        return all(tier.drain(timeout_s) for tier in self.tiers)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def _copy(self, block_id: int) -> torch.Tensor:
        """Block ``block_id``'s K/V, every layer, as a flat byte tensor of its own (on the CPU)."""
        block = self.cache.kv[:, :, block_id].to("cpu", memory_format=torch.contiguous_format, copy=True)
        return block.reshape(-1).view(torch.uint8)

    def _publish(self, h: int, data: torch.Tensor, tenant: str | None) -> None:
        """Queue block ``h`` to every shared tier; remembered when every one took it."""
        if all([tier.put(h, data, tenant=tenant) for tier in self.shared]):
            self._published[h] = None
            if len(self._published) > PUBLISHED:
                self._published.popitem(last=False)

    def _read(self, h: int) -> torch.Tensor | None:
        """Block ``h`` from the first tier that serves it intact and whole."""
        for tier in self.tiers:
            data = tier.get(h)
            if data is not None and data.numel() == self.block_nbytes:
                return data
        return None
