"""Prefix cache: which of a request's blocks can be found by hash, and registering them.

Pure Python, used by the scheduler. A request's block hashes are a chain
(engine/block_manager.py, ``block_hash``) rooted in the engine's salt (model,
dtype) and the request's own ``cache_salt``; they are computed once from its
tokens and kept on the request. ``lookup`` never returns the block holding a
request's last token, so at least one token is computed and a token sampled.
"""

from __future__ import annotations

from engine.block_manager import BlockManager, block_hash, root_hash
from engine.request import Request


class PrefixCache:
    def __init__(self, blocks: BlockManager, enabled: bool, salt: str) -> None:
        self.blocks = blocks
        self.enabled = enabled
        self.salt = salt

    def lookup(self, request: Request) -> list[int]:
        """Cached blocks of the request's longest cached prefix, its last token always left out."""
        if not self.enabled:
            return []
        return self.blocks.match(self.hashes(request, (request.num_tokens - 1) // self.blocks.block_size))

    def register(self, request: Request) -> None:
        """Make the request's blocks that became full and computed findable."""
        if not self.enabled:
            return
        full = min(request.num_computed // self.blocks.block_size, len(request.block_ids))
        if full <= request.num_hashed_blocks:
            return
        hashes = self.hashes(request, full)
        for i in range(request.num_hashed_blocks, full):
            self.blocks.cache(request.block_ids[i], hashes[i])
        request.num_hashed_blocks = full

    def hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first ``num_blocks`` full blocks (kept on the request)."""
        hashes, bs = request.block_hashes, self.blocks.block_size
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else root_hash(f"{self.salt}\0{request.cache_salt or ''}")
            for i in range(len(hashes), num_blocks):
                parent = block_hash(parent, request.token_ids(i * bs, (i + 1) * bs))
                hashes.append(parent)
        return hashes[:num_blocks]
