"""Blocks another server sent for a prompt about to be admitted here: decode-to-prefill reuse.

A prefill server whose reservation says the decode server holds a longer prefix
than its own cache does reads that prefix's K/V from the decode server
(prefill_server/service.py, kvlink/prefix_read.py), cuts it into blocks of its
own size and order, and offers them under its own chain hashes before it adds
the request. At admission the scheduler finds them as it finds a tier's blocks
(``available`` / ``load``, engine/prefix_cache.py ``lookup_tiers``): it copies
them into fresh blocks, computes only the rest, and registers them with the
computed ones, so this server's cache holds the prefix afterwards. The offer is
withdrawn when the request's prefill ends, used or not. A run of blocks may
alternate between the offer and the engine's own tiers (engine/tiers/kv.py):
this server's tier often holds a conversation's first turns, the offer the
later ones; each block is taken from whichever holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache import KVCache
from engine.prefix_cache import BlockTiers


class OfferedBlocks:
    """Offered blocks by hash (each ``kv[:, :, block]``'s shape), in front of ``inner`` (the engine's tiers)."""

    def __init__(self, cache: KVCache, inner: BlockTiers | None) -> None:
        self.cache = cache
        self.inner = inner
        self._blocks: dict[int, torch.Tensor] = {}
        self._by_request: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def offer(self, request_id: str, hashes: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        """Blocks ``blocks`` hold the K/V of chain hashes ``hashes``, for request ``request_id``."""
        assert len(hashes) == len(blocks), (len(hashes), len(blocks))
        self.withdraw(request_id)
        for h, block in zip(hashes, blocks):
            self._blocks[h] = block
        self._by_request[request_id] = list(hashes)

    def withdraw(self, request_id: str) -> int:
        """Forget what was offered for ``request_id`` (a prompt sharing the hashes finds them no more); how
        many blocks."""
        hashes = self._by_request.pop(request_id, [])
        for h in hashes:
            self._blocks.pop(h, None)
        return len(hashes)

    def available(self, hashes: Sequence[int]) -> int:
        """The run of ``hashes`` that is offered or listed by the inner tiers, in any alternation (this
        server's own tier often holds a conversation's first turns, the offer the later ones)."""
        n = 0
        while n < len(hashes):
            m = n
            while m < len(hashes) and hashes[m] in self._blocks:
                m += 1
            if m == n and self.inner is not None:
                m += self.inner.available(hashes[n:])
            if m == n:
                break
            n = m
        return n

    def load(self, hashes: Sequence[int], block_ids: Sequence[int]) -> int:
        """Copy the blocks of ``hashes`` into ``block_ids``: offered ones from the offer, the others from
        the inner tiers; how many were copied in a run from the first."""
        n = 0
        while n < len(hashes):
            if (block := self._blocks.get(hashes[n])) is not None:
                self.cache.kv[:, :, block_ids[n]].copy_(block)
                n += 1
                continue
            if self.inner is None:
                break
            m = n
            while m < len(hashes) and hashes[m] not in self._blocks:
                m += 1
            got = self.inner.load(hashes[n:m], block_ids[n:m])
            n += got
            if n < m:  # the inner tiers did not serve one intact: the run ends there
                break
        return n


def read_tokens(cache: KVCache, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
    """Every layer's K and V of tokens [start, end) of a request whose blocks are ``block_ids``, as one
    contiguous CPU tensor [layers, K|V, tokens, heads, width] whatever the cache's block size and order.
    On the CPU each block's part is copied once, straight into the result, by numpy: one thread, no
    OpenMP team (this runs off the engine thread, whose team must stay the only one, see
    server_common/engine_thread.py ``build_engine``), and the GIL released while it copies. On an
    accelerator the blocks are gathered there and come over in one copy."""
    bs = cache.block_size
    first, last = start // bs, -(-end // bs)
    blocks = cache.kv.transpose(3, 4) if cache.order == "HND" else cache.kv  # [layers, 2, n, slot, head, width]
    if cache.kv.device.type != "cpu":
        ids = torch.tensor(list(block_ids[first:last]), dtype=torch.long, device=cache.kv.device)
        tokens = blocks.index_select(2, ids).flatten(2, 3)
        return tokens[:, :, start - first * bs : end - first * bs].to("cpu").contiguous()
    layers, _, _, _, heads, width = blocks.shape
    out = torch.empty((layers, 2, end - start, heads, width), dtype=cache.dtype)
    # As bytes (the width's last): numpy knows no bfloat16.
    src, dst = blocks.view(torch.uint8).numpy(), out.view(torch.uint8).numpy()
    for i in range(first, last):
        a, b = max(start, i * bs), min(end, (i + 1) * bs)
        np.copyto(dst[:, :, a - start : b - start], src[:, :, block_ids[i], a - i * bs : b - i * bs])
    return out


@dataclass(frozen=True)
class PinnedRead:
    """Tokens of a reservation's cached prefix whose blocks a read pins (``LLMEngine.pin_reserved``):
    ``copy`` them from any thread, then ``LLMEngine.unpin`` on the engine thread. While pinned no block
    is freed, evicted or handed out, and nothing writes the slots read: full blocks are immutable once
    cached, and a kept tail's owner writes only past the tokens it was kept with."""

    pin_id: int
    cache: KVCache
    block_ids: tuple[int, ...]  # the blocks holding the tokens, the first one first
    start: int  # the first token, counted from the first block's first slot
    end: int

    def copy(self) -> torch.Tensor:
        """The tokens' K/V ([layers, K|V, tokens, heads, width], a CPU tensor of their own)."""
        return read_tokens(self.cache, self.block_ids, self.start, self.end)


def cut_blocks(cache: KVCache, tokens: torch.Tensor) -> list[torch.Tensor]:
    """``tokens`` ([layers, K|V, n, heads, width], n a multiple of the block size) as ``kv[:, :, block]``
    tensors of ``cache``'s block size and order, on its device: views of ``tokens`` where its device and
    dtype are the cache's (``OfferedBlocks.load`` copies each into the cache once), copies otherwise."""
    bs = cache.block_size
    assert tokens.shape[2] % bs == 0, (tokens.shape, bs)
    data = tokens.to(cache.kv.device, cache.dtype)
    blocks = []
    for i in range(tokens.shape[2] // bs):
        block = data[:, :, i * bs : (i + 1) * bs]
        blocks.append(block.transpose(2, 3) if cache.order == "HND" else block)
    return blocks
