"""The host-memory tier: blocks as CPU tensors in a dict, bounded by bytes.

On a GPU server this is the pool past the device's cache; on a CPU server it is
a second, larger pool beside the engine's own. Each entry keeps the CRC32 it was
written with and is checked on every read, as the disk tier's are.
"""

from __future__ import annotations

import torch

from engine.tiers.tier import Tier


class HostTier(Tier):
    name = "host"

    def __init__(self, max_bytes: int, queue_blocks: int = 256) -> None:
        super().__init__(max_bytes, queue_blocks)
        self._blocks: dict[int, tuple[torch.Tensor, int]] = {}
        self.start()

    def _persist(self, h: int, data: torch.Tensor, checksum: int) -> int:
        self._blocks[h] = (data, checksum)
        return data.numel()

    def _fetch(self, h: int) -> tuple[torch.Tensor, int] | None:
        return self._blocks.get(h)

    def _discard(self, h: int) -> None:
        self._blocks.pop(h, None)
