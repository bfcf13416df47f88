"""A prefix's K/V out of one cache and into another (engine/tiers/offered.py ``read_tokens``, ``cut_blocks``,
``OfferedBlocks.load``): every token's K and V land where the other cache's block size and order put them,
whatever range is read (on a block or not), and the offered blocks are views of what was read, copied once
into the cache at load."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache
from engine.tiers.offered import OfferedBlocks, cut_blocks, read_tokens

LAYERS, HEADS, WIDTH = 3, 2, 4


def cache(block: int, order: str, blocks: int = 8) -> KVCache:
    c = KVCache(LAYERS, blocks, block, HEADS, WIDTH, torch.float32, torch.device("cpu"), order)
    c.kv.copy_(torch.randn(c.kv.shape, generator=torch.Generator().manual_seed(block)))
    return c


def token(c: KVCache, block_ids: list[int], p: int) -> torch.Tensor:
    """Token ``p``'s K/V, [layers, K|V, heads, width], straight from the cache."""
    block, slot = block_ids[p // c.block_size], p % c.block_size
    return c.kv[:, :, block, :, slot] if c.order == "HND" else c.kv[:, :, block, slot]


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("start", "end"), [(0, 16), (0, 13), (4, 29), (8, 9), (17, 32)])
def test_a_read_holds_each_tokens_kv_in_order(order, start, end):
    c = cache(8, order)
    ids = [5, 2, 7, 0]
    tokens = read_tokens(c, ids, start, end)
    assert tokens.shape == (LAYERS, 2, end - start, HEADS, WIDTH) and tokens.is_contiguous()
    for p in range(start, end):
        assert torch.equal(tokens[:, :, p - start], token(c, ids, p))


@pytest.mark.parametrize(("src_order", "dst_order"), [("HND", "NHD"), ("NHD", "HND")])
def test_blocks_cut_from_a_read_load_into_another_caches_blocks(src_order, dst_order):
    src, dst = cache(8, src_order), cache(4, dst_order, blocks=10)
    dst.kv.zero_()
    src_ids, dst_ids = [6, 1, 3], [9, 0, 4, 2, 7, 5]
    tokens = read_tokens(src, src_ids, 0, 24)
    blocks = cut_blocks(dst, tokens)
    assert all(b.untyped_storage().data_ptr() == tokens.untyped_storage().data_ptr() for b in blocks)  # views
    offered = OfferedBlocks(dst, None)
    offered.offer("r", list(range(6)), blocks)
    assert offered.load(list(range(6)), dst_ids) == 6
    for p in range(24):
        assert torch.equal(token(dst, dst_ids, p), token(src, src_ids, p))
    assert offered.withdraw("r") == 6


class HeldBlocks:
    """A lower tier holding whole blocks by hash (engine/prefix_cache.py ``BlockTiers``), for the offer's
    ``inner``: what this server's own tier holds of a conversation."""

    def __init__(self, cache: KVCache, blocks: dict[int, torch.Tensor]) -> None:
        self.cache, self.blocks = cache, blocks

    def available(self, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def load(self, hashes, block_ids) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            self.cache.kv[:, :, block_ids[n]].copy_(self.blocks[hashes[n]])
            n += 1
        return n


def test_an_offer_continues_the_run_this_servers_own_tier_holds_and_the_tier_continues_the_offer():
    """Blocks 0-1 in this server's tier (its earlier turns), 2-3 offered (read from D), 4 in the tier again,
    5 nowhere: a run of 5 whichever holds each, every block copied from the one that holds it."""
    dst = cache(4, "NHD", blocks=8)
    src = [torch.full(dst.kv[:, :, 0].shape, float(h)) for h in range(6)]
    dst.kv.zero_()
    offered = OfferedBlocks(dst, HeldBlocks(dst, {0: src[0], 1: src[1], 4: src[4]}))
    offered.offer("r", [2, 3], [src[2], src[3]])
    assert offered.available(list(range(6))) == 5 and offered.available([5, 0]) == 0
    ids = [7, 6, 5, 4, 3, 2]
    assert offered.load(list(range(6)), ids) == 5
    assert [int(dst.kv[0, 0, i, 0, 0, 0]) for i in ids] == [0, 1, 2, 3, 4, 0]
