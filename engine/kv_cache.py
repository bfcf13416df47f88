"""The paged KV cache: one contiguous tensor per engine.

::

    NHD (default):
    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
          layer     K|V   block     slot (token)  head          dim

    HND:
    kv: [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
          layer     K|V   block     head          slot (token)  dim

One layer's K (or V) for all blocks is a single contiguous region, and one
block of one layer's K is ``block_size * num_kv_heads * head_dim`` contiguous
elements, so a transfer layer can address any (layer, K/V, block) by byte
offset: ``((layer * 2 + kv) * num_blocks + block) * block_bytes``; inside a
block the order is NHD or HND. One contiguous allocation also means one memory
registration for NIXL. NHD keeps a token's heads together (cheap slot writes);
HND keeps a head's tokens together, the order many GPU attention kernels read.

A rank of a tensor-parallel engine holds a cache of its own KV heads
(``head_ids``, global numbers of the model's ``num_kv_heads_total``; see
engine/tensor_parallel.py) with every block, the same block table as every
other rank: ``tp_rank``, ``tp_size`` and those two describe it to a transfer
layer (transfer/layout.py ``KVLayout.for_engine_cache``).

A model with multi-head latent attention (DeepSeek-V3) keeps one latent of
``L = kv_lora_rank + qk_rope_head_dim`` values per token and layer instead of K
and V: its cache is one KV head of width L / 2, the latent's first half in the
K plane and its second half in the V plane (engine/mla.py), the same on every
tensor-parallel rank (one head, replicated)::

    kv: [num_layers, 2, num_blocks, block_size, 1, L / 2]      (NHD)
               K plane = latent[:L/2], V plane = latent[L/2:]

With a window pool (``window_kv_blocks``, engine/window_pool.py) a model mixing sliding-window and
full-attention layers keeps them apart, each tensor with its own blocks, and ``layers`` gives each
model layer its own::

    kv:        [full layers,   2, num_blocks,        ...]   block table: Request.block_ids
    window_kv: [window layers, 2, num_window_blocks, ...]   block table: Request.window_block_ids
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import KV_LAYOUTS, EngineConfig, KvLayout
from engine.mla import latent_width
from engine.request import window_start
from engine.tensor_parallel import Shard


def cache_heads(cfg, shard: Shard, head_dim: int) -> tuple[int, int, int]:
    """(KV heads rank ``shard`` holds, their width, the model's KV heads) of one layer's K (or V) plane:
    the model's KV heads of ``head_dim``, split as engine/tensor_parallel.py says; or for a latent of L
    values, one head of L / 2 on every rank."""
    width = latent_width(cfg)
    if width is not None:
        assert width % 2 == 0, width  # engine/loader.py check_features refuses an odd latent
        return 1, width // 2, 1
    return len(shard.kv_heads(cfg.num_key_value_heads)), head_dim, cfg.num_key_value_heads


def layer_tokens_sent(windows: Sequence[int | None], num_tokens: int, num_cached: int = 0) -> int:
    """Tokens of a ``num_tokens`` prompt a prefill server sends into a reservation already holding its first
    ``num_cached``, summed over the layers (``windows``: each layer's sliding window, None for full
    attention): a full layer's every token past the cached ones, a window layer's only those the decode
    server's first query (at position ``num_tokens``) reads, the last ``window - 1``. Times one layer's K
    and V of a token (``bytes_per_token // num_layers``): the bytes a request moves."""
    first = [num_cached if w is None else max(num_cached, window_start(num_tokens, w)) for w in windows]
    return sum(max(num_tokens - f, 0) for f in first)


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
        order: KvLayout,
        shard: Shard = Shard(),
        num_kv_heads_total: int | None = None,
        window_layers: Sequence[bool] = (),
        num_window_blocks: int = 0,
    ) -> None:
        """``window_layers`` (one per layer) and ``num_window_blocks``: with blocks, the layers marked True
        are cached in ``window_kv``, apart (a window pool); without, every layer is in ``kv``."""
        assert order in KV_LAYOUTS, order
        assert not num_window_blocks or (len(window_layers) == num_layers and 0 < sum(window_layers) < num_layers)
        self.tp_rank, self.tp_size = shard.rank, shard.size
        self.num_kv_heads_total = num_kv_heads if num_kv_heads_total is None else num_kv_heads_total
        self.head_ids = shard.kv_heads(self.num_kv_heads_total)
        assert len(self.head_ids) == num_kv_heads, (self.head_ids, num_kv_heads)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.order = order
        inner = (block_size, num_kv_heads) if order == "NHD" else (num_kv_heads, block_size)
        windowed = list(window_layers) if num_window_blocks else [False] * num_layers
        self.num_window_blocks = num_window_blocks
        self.window_kv: torch.Tensor | None = None
        self.kv = torch.zeros((windowed.count(False), 2, num_blocks, *inner, head_dim), dtype=dtype, device=device)
        if num_window_blocks:
            shape = (windowed.count(True), 2, num_window_blocks, *inner, head_dim)
            self.window_kv = torch.zeros(shape, dtype=dtype, device=device)
        # Each model layer's K|V planes: a view of kv, or of window_kv for a window layer of a window pool.
        self.layers: list[torch.Tensor] = []
        seen = {False: 0, True: 0}
        for is_window in windowed:
            source = self.window_kv if is_window else self.kv
            assert source is not None
            self.layers.append(source[seen[is_window]])
            seen[is_window] += 1

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies every layer's K and V of each (source, destination) block; all sources
        are read before any destination is written."""
        if not pairs:
            return
        assert self.window_kv is None, "with a window pool a fork is computed again, not copied"
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.kv.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.kv.device)
        self.kv[:, :, dst] = self.kv[:, :, src]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block of ``kv`` (every layer's, or the full layers' with a window pool)."""
        return 2 * self.kv.shape[0] * self.block_bytes

    @property
    def bytes_per_window_block(self) -> int:
        """K and V of one block of ``window_kv`` (the window layers'); 0 without a window pool."""
        return 0 if self.window_kv is None else 2 * self.window_kv.shape[0] * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @classmethod
    def for_shard(
        cls,
        cfg,
        shard: Shard,
        num_blocks: int,
        head_dim: int,
        config: EngineConfig,
        device: torch.device,
        window_layers: Sequence[bool] = (),
        num_window_blocks: int = 0,
    ) -> KVCache:
        """Rank ``shard``'s slice of model ``cfg``'s cache: every layer, its KV heads (:func:`cache_heads`),
        ``num_blocks`` blocks (every rank of an instance holds as many, under the same block table); with
        ``num_window_blocks``, the ``window_layers`` apart in a window pool."""
        heads, width, total = cache_heads(cfg, shard, head_dim)
        return cls(
            cfg.num_hidden_layers,
            num_blocks,
            config.block_size,
            heads,
            width,
            config.torch_dtype,
            device,
            order=config.kv_layout,
            shard=shard,
            num_kv_heads_total=total,
            window_layers=window_layers,
            num_window_blocks=num_window_blocks,
        )

    @staticmethod
    def blocks_for_bytes(
        budget: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return max(1, budget // KVCache.block_bytes_of(num_layers, block_size, num_kv_heads, head_dim, dtype))

    @staticmethod
    def block_bytes_of(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one block of ``num_layers`` layers."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
