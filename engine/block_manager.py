"""Block manager: pure Python bookkeeping of fixed-size KV blocks, with a prefix cache.

Every block is in one of three states::

    FREE          ref_count 0, no hash       in the free heap (lowest id first)
    CACHED-FREE   ref_count 0, hash set      in the LRU (oldest first), still findable by hash
    TAIL-FREE     ref_count 0, tail set      in the LRU, findable by its parent's hash (below)
    USED          ref_count >= 1             owned by that many requests (hash set if full and computed)

A full block whose K/V is computed is identified by a hash chained over its
tokens (:func:`block_hash`): the hash of block i covers every token of blocks
0..i and the salt, so equal hashes mean equal K/V. ``cache`` registers such a
block; ``match`` finds the longest run of cached blocks for a chain of hashes;
``take`` gives a request one more reference to each. A block whose last owner
frees it keeps its hash and goes to the LRU: it still counts as free for
capacity and is evicted (its hash dropped) only when a fresh block is needed
and the free heap is empty; ``on_evict(block_id, hash)`` is told first, while
the block still holds that K/V (engine/tiers/kv.py writes it to a lower tier),
for a block every layer of which holds all its slots; ``on_cached(block_id,
hash)`` likewise when such a block's last owner frees it (its K/V final and
findable: a shared KV tier publishes it then). Free blocks are handed out lowest id first, so a
fresh allocation is usually one contiguous run of ids: the transfer layer
merges contiguous runs into single writes.

A finished request's last block is usually partial: the end of its prompt, or
of its answer (the next turn of a conversation starts with both). ``keep_tail``
keeps such a block, when its owner frees it, findable by its parent's hash
(the block before it, or the chain's root) with the tokens whose K/V it holds
(``Block.tail``): one tail per parent, the latest. ``take_tail`` gives it to a
request whose next tokens start with those tokens; the request owns it alone
(nobody else can find it any more) and writes its own tokens after them, so no
copy is made. A tail is never written to a tier or logged as a KV event, and an
evicted one is simply forgotten.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_events import KvEventLog

NO_HASH = -1


def root_hash(salt: str) -> int:
    """The parent hash of a chain's first block: everything besides tokens that changes K/V."""
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little")


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained on its parent's (sha256, 64 bits kept)."""
    data = parent.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int = NO_HASH
    # Slots before this one hold no K/V in sliding-window layers: a remote prompt's block whose window
    # layers arrived only for the prompt's last tokens (engine/prefix_cache.py trims hits over it).
    window_from: int = 0
    # Whose request made it findable here (``cache``): the tenant its copy in a shared KV tier is charged to.
    tenant: str | None = None
    # A kept tail (``keep_tail``): its parent's hash and the tokens whose K/V its first slots hold.
    tail: tuple[int, tuple[int, ...]] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, events: KvEventLog | None = None) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest id first
        self._free_set: set[int] = set(self._free)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with no owner, oldest first
        self._by_hash: dict[int, int] = {}  # hash -> block id, for every block holding a hash
        self._tails: dict[int, int] = {}  # parent hash -> block id of the tail kept after it (``keep_tail``)
        self.evictions = 0  # cached blocks whose hash was dropped to make room
        self.events = events or KvEventLog()  # every hash stored and evicted (engine/kv_events.py)
        self.on_evict: Callable[[int, int], None] | None = None  # (block id, hash) of a cached block evicted
        self.on_cached: Callable[[int, int], None] | None = None  # ... of a cached block its last owner freed

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free ones and cached ones with no owner."""
        return len(self._free) + len(self._lru)

    @property
    def num_plain_free(self) -> int:
        """Free blocks that hold nothing findable: taking one evicts nothing."""
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks: free ones lowest id first, then evict the least recently used."""
        if num_blocks > self.num_free:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free} free")
        ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id = heapq.heappop(self._free)
                self._free_set.remove(block_id)
            else:
                block_id, _ = self._lru.popitem(last=False)
                if not self._forget_tail(block_id):  # a kept tail is just forgotten
                    if self.on_evict is not None and self.blocks[block_id].window_from == 0:
                        self.on_evict(block_id, self.blocks[block_id].block_hash)
                    del self._by_hash[self.blocks[block_id].block_hash]
                    self.events.evicted(self.blocks[block_id].block_hash)
                    self.blocks[block_id].block_hash = NO_HASH
                    self.blocks[block_id].tenant = None
                    self.evictions += 1
            block = self.blocks[block_id]
            assert block.ref_count == 0
            block.ref_count = 1
            block.window_from = 0
            ids.append(block_id)
        return ids

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend ``block_ids`` in place to hold ``num_tokens``; False if blocks ran out."""
        missing = self.blocks_needed(num_tokens) - len(block_ids)
        if missing <= 0:
            return True
        if not self.can_allocate(missing):
            return False
        block_ids.extend(self.allocate(missing))
        return True

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero become free (or cached-free).

        The table is walked from its end, so a request's last blocks are the
        first evicted and its prefix stays findable longest.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash != NO_HASH:
                self._lru[block_id] = None
                if self.on_cached is not None and block.window_from == 0:
                    self.on_cached(block_id, block.block_hash)
            elif block.tail is not None:
                self._lru[block_id] = None
            else:
                heapq.heappush(self._free, block_id)
                self._free_set.add(block_id)

    def share(self, block_ids: Sequence[int]) -> None:
        """One more reference to each owned block (sequences of one request share their prompt's)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} is not owned"
            block.ref_count += 1

    # ---- prefix cache ---------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest run of ``hashes`` (a chain, first block first) that is cached."""
        ids = []
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    def match_all(self, hashes: Sequence[int]) -> list[int] | None:
        """Block ids of every one of ``hashes``, in order; None when one is not cached."""
        ids = [self._by_hash.get(h) for h in hashes]
        return None if None in ids else [i for i in ids if i is not None]

    def blocks_to_take(self, cached_ids: Sequence[int]) -> int:
        """How many free blocks taking ``cached_ids`` uses up (those with no owner now)."""
        return sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)

    def take(self, cached_ids: Sequence[int]) -> None:
        """One more reference to each cached block (out of the LRU if it had no owner)."""
        for block_id in cached_ids:
            block = self.blocks[block_id]
            assert block.block_hash != NO_HASH, f"block {block_id} is not cached"
            if block.ref_count == 0:
                del self._lru[block_id]
            block.ref_count += 1

    def cache(self, block_id: int, h: int, tenant: str | None = None) -> bool:
        """Make a full, computed, owned block findable by hash ``h``; ``tenant``: the request's that did.

        False when another block already holds that hash (two requests computed
        the same prefix at once): this one stays unhashed and is freed as usual.
        """
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} is not owned"
        if block.block_hash == h:
            return True
        assert block.block_hash == NO_HASH, f"block {block_id} already holds another hash"
        if h in self._by_hash:
            return False
        block.block_hash = h
        block.tenant = tenant
        self._by_hash[h] = block_id
        self.events.stored(h)
        return True

    # ---- tails: a finished request's last, partial block ----------------------
    def keep_tail(self, block_id: int, parent: int, token_ids: Sequence[int]) -> bool:
        """Keep block ``block_id``, unhashed and owned by the caller alone, whose first ``len(token_ids)``
        slots hold the K/V of ``token_ids`` after the chain ``parent``, findable by ``parent`` once the
        caller frees it (at once: a tail is never owned); a tail kept after ``parent`` before is freed."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} is not owned"
        if block.ref_count != 1 or block.block_hash != NO_HASH or not 0 < len(token_ids) < self.block_size:
            return False  # shared (its other owner may write it), full, or nothing to keep
        old = self._tails.get(parent)
        if old is not None:  # unowned: a tail is only kept by its last owner, who frees it at once
            del self._lru[old]
            self._forget_tail(old)
            heapq.heappush(self._free, old)
            self._free_set.add(old)
        block.tail = (parent, tuple(token_ids))
        self._tails[parent] = block_id
        return True

    def tail_after(self, parent: int, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the tail kept after ``parent`` holds: all of its own
        tokens when ``token_ids`` starts with them, else 0 (nothing is taken)."""
        block_id = self._tails.get(parent)
        if block_id is None:
            return 0
        tail = self.blocks[block_id].tail
        assert tail is not None
        n = len(tail[1])
        return n if n <= len(token_ids) and tuple(token_ids[:n]) == tail[1] else 0

    def take_tail(self, parent: int, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """Hand the tail kept after ``parent`` to a request whose next tokens are ``token_ids`` (it starts
        with the tail's tokens): (block id, tokens it holds), the block owned by the caller alone and
        findable no more; None when there is no such tail."""
        n = self.tail_after(parent, token_ids)
        if not n:
            return None
        block_id = self._tails[parent]
        block = self.blocks[block_id]
        del self._lru[block_id]
        self._forget_tail(block_id)
        block.ref_count = 1
        block.window_from = 0
        return block_id, n

    def _forget_tail(self, block_id: int) -> bool:
        """Drop block ``block_id``'s kept tail, if it has one (the caller moves the block)."""
        block = self.blocks[block_id]
        if block.tail is None:
            return False
        if self._tails.get(block.tail[0]) == block_id:
            del self._tails[block.tail[0]]
        block.tail = None
        return True

    @property
    def num_tails(self) -> int:
        """Tails kept now, owned or not."""
        return len(self._tails)

    def check_integrity(self) -> None:
        """free + cached-free + used == total, and every list agrees with the ref counts and hashes."""
        assert len(self._free) == len(self._free_set), "duplicate ids in the free list"
        assert not self._free_set & self._lru.keys(), "a block is both free and cached-free"
        for block in self.blocks:
            is_free = block.block_id in self._free_set or block.block_id in self._lru
            assert is_free == (block.ref_count == 0), f"block {block.block_id} inconsistent"
            if block.block_id in self._free_set:
                assert block.block_hash == NO_HASH, f"free block {block.block_id} holds a hash"
            if block.block_id in self._lru:
                assert (block.block_hash != NO_HASH) != (block.tail is not None), (
                    f"cached-free block {block.block_id} holds no hash or tail, or both"
                )
            if block.tail is not None:
                assert self._tails.get(block.tail[0]) == block.block_id, f"tail block {block.block_id} not indexed"
            if block.block_hash != NO_HASH:
                assert self._by_hash.get(block.block_hash) == block.block_id, f"block {block.block_id} not indexed"
        assert len(self._by_hash) == sum(1 for b in self.blocks if b.block_hash != NO_HASH)
        assert len(self._tails) == sum(1 for b in self.blocks if b.tail is not None)
        assert len(self._free) + len(self._lru) + self.num_used == self.num_blocks
