"""The router's KV index fed from engine event logs, for cache-aware routing tests: the
replies a server's event log gives, and an index where named servers hold a prompt's blocks."""

from __future__ import annotations

from engine.kv_events import KvEventLog
from engine.prefix_cache import chain_hashes
from router.cluster.kv_index import KvIndex
from wire.replies import KvBlocksReply, KvEventsReply

SALT = "model|float32"


def page(log: KvEventLog, after: int, block_size: int = 4) -> KvEventsReply:
    p = log.since(after)
    return KvEventsReply(
        epoch=p.epoch, oldest=p.oldest, last=p.last, events=p.events, block_size=block_size, salt=SALT, enabled=True
    )


def snapshot(log: KvEventLog, block_size: int = 4) -> KvBlocksReply:
    s = log.snapshot()
    return KvBlocksReply(
        epoch=s.epoch, seq=s.seq, hashes=s.hashes, tiered=s.tiered, block_size=block_size, salt=SALT, enabled=True
    )


def index_holding(blocks: dict[str, int], prompt: list[int], block_size: int = 4) -> KvIndex:
    """An index where each named server holds the prompt's first ``blocks[name]`` blocks."""
    index = KvIndex()
    hashes = chain_hashes(SALT, prompt, block_size)
    for name, n in blocks.items():
        log = KvEventLog(epoch=name)
        for h in hashes[:n]:
            log.stored(h)
        index.of(name).load(snapshot(log, block_size))
    return index
