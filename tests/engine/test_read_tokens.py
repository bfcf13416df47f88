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
