"""Prefix cache: which of a request's blocks can be found by hash, and registering them.

Pure Python, used by the scheduler. A request's block hashes are a chain
(engine/block_manager.py, ``block_hash``) rooted in the engine's salt (model,
dtype) and the request's own ``cache_salt``; they are computed once from its
tokens and kept on the request. ``lookup`` never returns the block holding a
request's last token, so at least one token is computed and a token sampled.

Sliding windows: a prompt whose K/V a prefill server wrote holds its
window layers' K/V only for the positions its first decode reads, the last
``window - 1`` (prefill_server/service.py sends no more). ``mark_remote``
notes it on the blocks (``Block.window_from``) and ``lookup`` takes a hit of
``c`` tokens only when positions (c - window, c) hold every layer's K/V::

    remote prompt of n tokens, window W:   ..... | ..... | ..WWW | WWWW.
    positions with window-layer K/V: W     (from n - W + 1 on; decoded ones too)
    a hit ending at c reads (c - W, c):    ok only if those are all W

With a window pool (engine/window_pool.py) the window layers' blocks are found by the same hashes in the
pool's own block manager, and a hit is taken only as far as the pool still holds the blocks of (c - W, c).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.block_manager import BlockManager, block_hash, root_hash
from engine.request import Request, window_start
from engine.window_pool import WindowPool


def chain_root(engine_salt: str, cache_salt: str | None = None) -> int:
    """The parent of a chain's first block: the engine's salt (``EngineConfig.cache_salt``:
    model, dtype) and the request's own ``cache_salt``."""
    return root_hash(f"{engine_salt}\0{cache_salt or ''}")


def chain_hashes(
    engine_salt: str, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    """The chained hashes of every full block of ``token_ids``, exactly as an engine with
    that salt and block size computes them. Pure and torch-free: the router calls it too
    (router/cluster/kv_index.py)."""
    parent, hashes = chain_root(engine_salt, cache_salt), []
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockTiers(Protocol):
    """Lower tiers holding evicted blocks by hash (engine/tiers/kv.py ``KvTiers``)."""

    def available(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, in a run from the first, some tier lists."""
        ...

    def load(self, hashes: Sequence[int], block_ids: Sequence[int]) -> int:
        """Copy blocks ``hashes`` into ``block_ids``, first first, until one is not served; how many."""
        ...


class PrefixCache:
    def __init__(
        self,
        blocks: BlockManager,
        enabled: bool,
        salt: str,
        window: int | None = None,
        window_pool: WindowPool | None = None,
    ) -> None:
        """``window``: the widest sliding window of the model's layers (None: no layer has one);
        ``window_pool``: where the window layers' blocks are, when not in ``blocks`` (engine/window_pool.py)."""
        self.blocks = blocks
        self.enabled = enabled
        self.salt = salt
        self.window = window
        self.window_pool = window_pool

    def lookup(self, request: Request) -> list[int]:
        """Cached blocks of the request's longest cached prefix, its last token always left out; none
        for a request that wants its prompt's log-probabilities (its whole prompt is computed)."""
        if not self.enabled or request.wants_prompt_logprobs:
            return []
        ids = self.blocks.match(self.hashes(request, (request.num_tokens - 1) // self.blocks.block_size))
        while ids and not (self._window_held(ids) and self.window_hit(request, len(ids)) is not None):
            ids.pop()
        return ids

    def window_hit(self, request: Request, num_blocks: int) -> list[int] | None:
        """The window pool's blocks a hit of the request's first ``num_blocks`` blocks takes (``[]`` with no
        window pool); None when the pool lacks one of them."""
        if self.window_pool is None:
            return []
        return self.window_pool.hit(self.hashes(request, num_blocks))

    def lookup_tiers(self, request: Request, cached: list[int], tiers: BlockTiers | None) -> list[int]:
        """Hashes of the blocks after ``cached`` (what ``lookup`` found) that ``tiers`` list, in a run, the
        request's last token always left out; a loaded block holds every layer's K/V, so the run is trimmed
        only where the window of a hit ending in it would reach a cached block that does not."""
        if tiers is None or not self.enabled or request.wants_prompt_logprobs:
            return []
        limit = (request.num_tokens - 1) // self.blocks.block_size
        if len(cached) >= limit:
            return []
        hashes = self.hashes(request, limit)[len(cached) :]
        n = tiers.available(hashes)
        froms = [self.blocks.blocks[i].window_from for i in cached]
        while n and not self._window_held_from(froms + [0] * n):
            n -= 1
        return hashes[:n]

    # ---- tails (engine/block_manager.py, ``keep_tail``) ------------------------
    def _tails_on(self, request: Request) -> bool:
        """Whether tails are kept and taken for this request: prefix caching on, no sliding window (a
        tail would need its window's K/V tracked slot by slot), no log-probabilities of its prompt."""
        return self.enabled and self.window is None and self.window_pool is None and not request.wants_prompt_logprobs

    def _tail_key(self, request: Request, num_blocks: int) -> int:
        """The parent hash of the request's block ``num_blocks``: its chain up to there."""
        return self.hashes(request, num_blocks)[-1] if num_blocks else chain_root(self.salt, request.cache_salt)

    def keep_tail(self, request: Request) -> None:
        """Before a finished request's blocks are freed: keep its last block, when partial and computed
        in part, findable by the chain before it (the next turn of its conversation starts with it)."""
        if not self._tails_on(request) or request.released_blocks:
            return
        bs = self.blocks.block_size
        full = request.num_computed // bs
        k = request.num_computed - full * bs
        if k == 0 or full >= len(request.block_ids) or full > request.num_hashed_blocks:
            return
        tokens = request.token_ids(full * bs, request.num_computed)
        self.blocks.keep_tail(request.block_ids[full], self._tail_key(request, full), tokens)

    def _tail_tokens(self, request: Request, num_cached: int) -> list[int]:
        """What a tail after the request's first ``num_cached`` blocks may cover: the next tokens, at most
        a block's less one, its last token always left out."""
        start = num_cached * self.blocks.block_size
        return request.token_ids(start, min(start + self.blocks.block_size - 1, request.num_tokens - 1))

    def tail_hit(self, request: Request, num_cached: int) -> int:
        """Tokens a kept tail would add after the request's first ``num_cached`` cached blocks (nothing is
        taken)."""
        if not self._tails_on(request) or not self.blocks.num_tails:
            return 0
        tokens = self._tail_tokens(request, num_cached)
        return self.blocks.tail_after(self._tail_key(request, num_cached), tokens) if tokens else 0

    def take_tail(self, request: Request, num_cached: int) -> tuple[int, int] | None:
        """Take the kept tail after the request's first ``num_cached`` cached blocks: (block id, tokens it
        holds), the block now the request's alone; None when none fits."""
        if not self.tail_hit(request, num_cached):
            return None
        return self.blocks.take_tail(self._tail_key(request, num_cached), self._tail_tokens(request, num_cached))

    def mark_remote(self, request: Request) -> None:
        """The request's prompt K/V past its cached prefix was written remotely: its window layers hold
        only positions from ``num_prompt_tokens - window + 1`` on (the first decode query's window)."""
        if self.window is None:
            return
        bs, first = self.blocks.block_size, window_start(request.num_prompt_tokens, self.window)
        for i in range(request.num_cached_tokens // bs, len(request.block_ids)):
            self.blocks.blocks[request.block_ids[i]].window_from = min(max(first - i * bs, 0), bs)

    def _window_held(self, ids: list[int]) -> bool:
        """Whether every block of a hit of ``ids`` holds window-layer K/V where the next query reads it."""
        return self._window_held_from([self.blocks.blocks[i].window_from for i in ids])

    def _window_held_from(self, froms: list[int]) -> bool:
        """``_window_held`` for a hit whose blocks' ``window_from`` are ``froms``."""
        if self.window is None:
            return True
        bs, end = self.blocks.block_size, len(froms) * self.blocks.block_size
        first = max(end - self.window + 1, 0)  # the first position a query at ``end`` reads
        for i in range(first // bs, len(froms)):
            if froms[i] > max(first - i * bs, 0):
                return False
        return True

    def register(self, request: Request) -> None:
        """Make the request's blocks that became full and computed findable."""
        if not self.enabled:
            return
        full = min(request.num_computed // self.blocks.block_size, len(request.block_ids))
        if full <= request.num_hashed_blocks:
            return
        hashes = self.hashes(request, full)
        for i in range(request.num_hashed_blocks, full):
            self.blocks.cache(request.block_ids[i], hashes[i], request.tenant)
        if self.window_pool is not None:
            self.window_pool.register(request, hashes, request.num_hashed_blocks)
        request.num_hashed_blocks = full

    def hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first ``num_blocks`` full blocks (kept on the request)."""
        hashes, bs = request.block_hashes, self.blocks.block_size
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else chain_root(self.salt, request.cache_salt)
            for i in range(len(hashes), num_blocks):
                parent = block_hash(parent, request.token_ids(i * bs, (i + 1) * bs))
                hashes.append(parent)
        return hashes[:num_blocks]
