"""The paged KV cache: one contiguous tensor per engine.

::

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
          layer     K|V   block     slot (token)  head          dim      (NHD)

One layer's K (or V) for all blocks is a single contiguous region, and one
block of one layer's K is ``block_size * num_kv_heads * head_dim`` contiguous
elements, so a transfer layer can address any (layer, K/V, block) by byte
offset: ``((layer * 2 + kv) * num_blocks + block) * block_bytes``.
One contiguous allocation also means one memory registration for NIXL.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @staticmethod
    def blocks_for_bytes(budget: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> int:
        per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        return max(1, budget // per_block)
