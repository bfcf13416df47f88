"""Window layers' own blocks, for a model whose layers mix sliding windows and full attention (Gemma 3).

One block table serves every layer, so a full-attention layer that still reads a block keeps it for the
window layers too, and a window layer holds K/V its window left long ago. With ``window_kv_blocks`` set
(engine/config.py), the window layers' K/V lives in a cache tensor of its own (engine/kv_cache.py
``KVCache.window_kv``), in blocks of this pool, and each sequence has a second table
(``Request.window_block_ids``) that gives its front blocks back as the window passes them, as the one
table of a model whose every layer slides does (engine/scheduler.py ``_release_out_of_window``)::

    positions         0 .. 3 | 4 .. 7 | 8 .. 11 | 12 .. 15 | 16 17     (window 8, next query at 18)
    block_ids         b0       b1       b2        b3         b4        full layers: every block
    window_block_ids  .        .        w2        w3         w4        window layers: keys 11..17
                      placeholders: never read unmasked (attention masks keys outside the window)

Per sequence of n tokens: ceil(n / block_size) blocks of the full layers and at most
ceil((window - 1) / block_size) + 1 of the window layers once it decodes (a prompt chunk of c tokens
holds up to ceil(c / block_size) more while it is computed). vLLM's hybrid KV cache manager keeps a group
of blocks per attention type the same way.

Prefix caching: a window block is findable by the same chained hash as the full layers' block of those
positions (``register``); a hit of k blocks is taken only where this pool still holds the blocks of its
last ``window - 1`` tokens, what the query after it reads (``hit``); the hit's earlier window blocks are
placeholders. Pure Python, as the block manager.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.block_manager import BlockManager
from engine.request import Request, window_start

PLACEHOLDER = 0  # the id a window table holds for a block it does not hold (read, then masked)


class WindowPool:
    def __init__(self, blocks: BlockManager, window: int) -> None:
        """``blocks``: the window layers' blocks; ``window``: their (widest) sliding window."""
        self.blocks = blocks
        self.window = window

    def first_block(self, position: int) -> int:
        """The first block a query at ``position`` reads."""
        return window_start(position, self.window) // self.blocks.block_size

    def missing(self, request: Request, num_tokens: int) -> int:
        """Blocks the request's window table lacks to hold ``num_tokens`` tokens."""
        return max(self.blocks.blocks_needed(num_tokens) - len(request.window_block_ids), 0)

    def grow(self, request: Request, num_tokens: int) -> None:
        """Extend the request's window table to hold ``num_tokens`` (``missing`` blocks must be free)."""
        grown = self.blocks.grow(request.window_block_ids, num_tokens)
        assert grown, (request.request_id, num_tokens)

    def release(self, request: Request) -> None:
        """Give back the blocks before the first its next query (at ``num_computed``) reads; every later
        query reads later keys. A block still cached keeps its K/V for whoever finds it."""
        below = min(self.first_block(request.num_computed), len(request.window_block_ids))
        if below > request.window_released:
            self.blocks.free(request.window_block_ids[request.window_released : below])
            request.window_released = below

    def free(self, request: Request) -> None:
        """Give back every window block the request holds (it finished or was preempted)."""
        self.blocks.free(request.held_window_block_ids)
        request.window_block_ids, request.window_released = [], 0

    def hit(self, hashes: Sequence[int]) -> list[int] | None:
        """The window blocks a prefix hit of the blocks ``hashes`` (a chain, first block first) needs, those
        holding the keys the query after it reads; None when one of them is not cached here."""
        return self.blocks.match_all(hashes[self.first_block(len(hashes) * self.blocks.block_size) :])

    def take(self, request: Request, num_blocks: int, ids: list[int]) -> None:
        """Give a request without window blocks a hit of ``num_blocks`` blocks: its last ``ids`` (what
        ``hit`` found) taken, the ones before them placeholders."""
        assert not request.window_block_ids and len(ids) <= num_blocks
        self.blocks.take(ids)
        request.window_released = num_blocks - len(ids)
        request.window_block_ids = [PLACEHOLDER] * request.window_released + ids

    def register(self, request: Request, hashes: Sequence[int], start: int) -> None:
        """Make window blocks ``start .. len(hashes) - 1`` of the request (full and computed) findable by
        ``hashes``, those it holds."""
        for i in range(max(start, request.window_released), len(hashes)):
            self.blocks.cache(request.window_block_ids[i], hashes[i], request.tenant)

    def check_integrity(self, sequences: Sequence[Request]) -> None:
        """Every window block held is owned as many times as sequences hold it, and no other is used."""
        self.blocks.check_integrity()
        owners = Counter(b for r in sequences for b in r.held_window_block_ids)
        for request in sequences:
            held = request.held_window_block_ids
            assert len(held) == len(set(held)), f"{request.request_id} holds a window block twice"
        for block_id, n in owners.items():
            assert self.blocks.blocks[block_id].ref_count == n, f"window block {block_id}: {n} owners"
        assert len(owners) == self.blocks.num_used, f"{len(owners)} window blocks owned, {self.blocks.num_used} used"
