"""Block manager: pure Python bookkeeping of fixed-size KV blocks.

Blocks are ref-counted so that hash-based prefix caching can share a block
between requests later (``block_hash`` is kept for that, unused today). Free
blocks are handed out lowest id first, so a fresh allocation is usually one
contiguous run of ids: the transfer layer merges contiguous runs into single
writes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int = -1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest id first
        self._free_set: set[int] = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (lowest ids first)."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        ids = [heapq.heappop(self._free) for _ in range(num_blocks)]
        for block_id in ids:
            self._free_set.remove(block_id)
            block = self.blocks[block_id]
            assert block.ref_count == 0
            block.ref_count = 1
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
        """Drop one reference to each block; blocks reaching zero become free."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                block.block_hash = -1
                heapq.heappush(self._free, block_id)
                self._free_set.add(block_id)

    def check_integrity(self) -> None:
        """free + used == total, and the free list agrees with the ref counts."""
        assert len(self._free) == len(self._free_set), "duplicate ids in the free list"
        for block in self.blocks:
            is_free = block.block_id in self._free_set
            assert is_free == (block.ref_count == 0), f"block {block.block_id} inconsistent"
        assert self.num_free + self.num_used == self.num_blocks
