"""Where every K/V vector of a paged KV cache lives, in bytes.

A cache is ONE contiguous memory region. Its logical content is, for every
layer, K and V, token slot and KV head, one vector of ``head_dim`` elements.
``KVLayout`` maps (layer, kv, block, slot, head) to the byte offset of that
vector, so copy plans can be computed with integer arithmetic only (no torch).

Block layouts (one layer shown; ``L`` layers follow each other)::

    kv_fused=False (the engine's layout, [L, 2, B, ...]):
      layer l: | K plane: blk0 blk1 ... blk(B-1) | V plane: blk0 blk1 ... blk(B-1) |
    kv_fused=True ([L, B, 2, ...]):
      layer l: | blk0: K V | blk1: K V | ... | blk(B-1): K V |

    inside one block of block_size=4 slots (t0..t3), 2 heads (h0, h1),
    each cell one head_dim vector:
      NHD [slot, head, dim]:  t0h0 t0h1 | t1h0 t1h1 | t2h0 t2h1 | t3h0 t3h1
      HND [head, slot, dim]:  t0h0 t1h0 t2h0 t3h0 | t0h1 t1h1 t2h1 t3h1

Tensor parallelism: a rank holds a subset of the model's KV heads,
``head_ids`` (global head numbers, in local order). With more ranks than KV
heads, heads are replicated (rank r holds head r * heads // tp_size), as vLLM
does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ITEMSIZE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
ORDERS = ("NHD", "HND")


class IncompatiblePeer(ValueError):
    """Two sides that cannot exchange KV (different model, layers, head_dim...)."""


@dataclass(frozen=True)
class KVLayout:
    """Byte layout of one engine's KV cache region (see the module docstring)."""

    num_layers: int
    num_kv_heads_total: int
    head_ids: tuple[int, ...]
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str = "float32"
    order: str = "NHD"
    kv_fused: bool = False
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_ids", tuple(int(h) for h in self.head_ids))
        for name in ("num_layers", "num_kv_heads_total", "head_dim", "block_size", "num_blocks"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")
        if self.order not in ORDERS:
            raise ValueError(f"KVLayout.order {self.order!r} is not one of {ORDERS}")
        if not self.head_ids or len(set(self.head_ids)) != len(self.head_ids):
            raise ValueError(f"KVLayout.head_ids {self.head_ids!r} must be non-empty and distinct")
        if min(self.head_ids) < 0 or max(self.head_ids) >= self.num_kv_heads_total:
            raise ValueError(f"KVLayout.head_ids {self.head_ids!r} outside [0, {self.num_kv_heads_total})")

    # -- constructors ----------------------------------------------------
    @classmethod
    def for_engine_cache(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: object,  # a name ("bfloat16") or a torch dtype
        tp_rank: int = 0,
        tp_size: int = 1,
        num_kv_heads_total: int | None = None,
        head_ids: Sequence[int] | None = None,
        order: str = "NHD",
    ) -> KVLayout:
        """Layout of the engine's cache tensor
        ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (``order="NHD"``)
        or ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` (``"HND"``).

        ``num_kv_heads`` is what this rank holds, ``head_ids`` which ones (global
        ids, in the cache's order: the engine's split, ``engine.kv_cache.KVCache.head_ids``;
        needed with ``tp_size`` > 1, else every head); ``num_kv_heads_total`` is the
        model's count (defaults to ``num_kv_heads * tp_size``; pass it when heads are
        replicated). ``dtype`` is a name ("bfloat16") or a torch dtype.
        """
        total = num_kv_heads_total if num_kv_heads_total is not None else num_kv_heads * tp_size
        if head_ids is None:
            if tp_size != 1:
                raise ValueError(f"rank {tp_rank}/{tp_size}: say which KV heads it holds (head_ids)")
            head_ids = range(num_kv_heads)
        heads = tuple(int(h) for h in head_ids)
        if len(heads) != num_kv_heads:
            raise ValueError(f"rank {tp_rank}/{tp_size} holds KV heads {heads}, but the cache has {num_kv_heads}")
        return cls(
            num_layers=num_layers,
            num_kv_heads_total=total,
            head_ids=heads,
            head_dim=head_dim,
            block_size=block_size,
            num_blocks=num_blocks,
            dtype=dtype_name(dtype),
            order=order,
            kv_fused=False,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def replace(self, **changes) -> KVLayout:
        return dataclasses.replace(self, **changes)

    # -- sizes -------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def num_heads(self) -> int:
        """KV heads held by this rank."""
        return len(self.head_ids)

    @property
    def vec_bytes(self) -> int:
        """Bytes of one head_dim vector: the smallest unit a plan moves."""
        return self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or of V) in one layer."""
        return self.block_size * self.num_heads * self.vec_bytes

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of a tensor holding this layout (element type ``dtype``)."""
        inner = (self.block_size, self.num_heads) if self.order == "NHD" else (self.num_heads, self.block_size)
        outer = (self.num_blocks, 2) if self.kv_fused else (2, self.num_blocks)
        return (self.num_layers, *outer, *inner, self.head_dim)

    # -- offsets -----------------------------------------------------------
    def chunk_offsets(self, kv, block):
        """Offset inside a layer of the (kv, block) chunk of ``block_bytes``."""
        kv = np.asarray(kv, dtype=np.int64)
        block = np.asarray(block, dtype=np.int64)
        if self.kv_fused:
            return (block * 2 + kv) * self.block_bytes
        return (kv * self.num_blocks + block) * self.block_bytes

    def vector_offsets(self, kv, block, slot, head_index):
        """Byte offsets, inside layer 0, of the vectors at (kv, block, slot,
        local head index); arguments broadcast like numpy arrays. Add
        ``layer * layer_bytes`` for another layer."""
        slot = np.asarray(slot, dtype=np.int64)
        head_index = np.asarray(head_index, dtype=np.int64)
        if self.order == "NHD":
            inner = (slot * self.num_heads + head_index) * self.vec_bytes
        else:
            inner = (head_index * self.block_size + slot) * self.vec_bytes
        return self.chunk_offsets(kv, block) + inner

    def local_head_index(self, global_heads) -> np.ndarray:
        """Local positions of global head ids (all must be held here)."""
        where = {h: i for i, h in enumerate(self.head_ids)}
        return np.array([where[h] for h in global_heads], dtype=np.int64)

    def check_block_ids(self, block_ids, num_tokens_end: int, what: str) -> np.ndarray:
        """Validate a block table that must hold tokens [0, num_tokens_end)."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        need = -(-num_tokens_end // self.block_size)
        if len(ids) < need:
            raise ValueError(f"{what}: {len(ids)} blocks of {self.block_size} cannot hold {num_tokens_end} tokens")
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"{what}: block id outside [0, {self.num_blocks}): {ids.tolist()}")
        if len(np.unique(ids[:need])) != need:
            raise ValueError(f"{what}: block ids repeat: {ids.tolist()}")
        return ids


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'."""
    name = str(dtype)
    name = name.removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported KV dtype {dtype!r}; supported: {sorted(ITEMSIZE)}")
    return name


def check_compatible(
    local_model: str, local: KVLayout, peer_model: str, peer: KVLayout, local_role: str, peer_role: str
) -> None:
    """Refuse peers whose KV cannot be converted into ours.

    Model, layer count, head_dim and the model's total KV heads must match;
    block size, order, dtype, K/V fusion and TP split are converted.
    The error names both values, e.g. "num_layers: prefill has 28, decode has 24".
    """
    pairs = [
        ("model", local_model, peer_model),
        ("num_layers", local.num_layers, peer.num_layers),
        ("head_dim", local.head_dim, peer.head_dim),
        ("num_kv_heads_total", local.num_kv_heads_total, peer.num_kv_heads_total),
    ]
    for name, mine, theirs in pairs:
        if mine != theirs:
            raise IncompatiblePeer(
                f"{name}: {local_role} has {mine!r}, {peer_role} has {theirs!r}; KV cannot be exchanged between them"
            )
