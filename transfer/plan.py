"""Copy plans: which byte ranges of a source cache go where in a destination.

Pure functions over ``KVLayout``s and block tables. A plan is computed for
layer 0 and shifted by each side's ``layer_bytes`` for the other layers
(every layer has the same layout), so one plan serves a whole prefill chunk.

Token position ``p`` lives in source block ``src_block_ids[p // src.block_size]``
at slot ``p % src.block_size``, and likewise in the destination. For each
position in ``[start, end)``, K and V, and each KV head both sides hold, one
``head_dim`` vector is copied. Ranges are sorted by source offset and runs that
are contiguous on both sides are merged, so identical layouts with contiguous
block ids move as a few large ranges.

A dtype change is not a copy: the sender first converts its blocks into a
staging region laid out as ``staging_layout(src, dst.dtype)`` (same block ids)
and the plan is made from that staging layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transfer.layout import KVLayout


@dataclass(frozen=True)
class CopyPlan:
    """Byte ranges for layer 0; ``layer(l)`` gives them for layer ``l``.

    Offsets are relative to the start of each side's cache region.
    """

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    src_layer_bytes: int
    dst_layer_bytes: int
    heads: tuple[int, ...]  # global KV head ids copied

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src_offsets, dst_offsets, lengths) for one layer, int64 arrays."""
        return (
            self.src_offsets + layer * self.src_layer_bytes,
            self.dst_offsets + layer * self.dst_layer_bytes,
            self.lengths,
        )

    def ranges(self, layer: int) -> list[tuple[int, int, int]]:
        """The plan of one layer as (src_offset, dst_offset, length) tuples."""
        src, dst, length = self.layer(layer)
        return list(zip(src.tolist(), dst.tolist(), length.tolist()))

    @property
    def num_ranges(self) -> int:
        return len(self.lengths)

    @property
    def layer_nbytes(self) -> int:
        """Bytes moved per layer."""
        return int(self.lengths.sum())


def staging_layout(src: KVLayout, dtype: str) -> KVLayout:
    """Layout of the sender's converted copy of its cache (same block ids)."""
    return src.replace(dtype=dtype)


def common_heads(src: KVLayout, dst: KVLayout) -> tuple[int, ...]:
    """Global KV heads both sides hold, in the source's order."""
    held = set(dst.head_ids)
    return tuple(h for h in src.head_ids if h in held)


def make_plan(src: KVLayout, src_block_ids, start: int, end: int, dst: KVLayout, dst_block_ids, heads=None) -> CopyPlan:
    """Plan copying tokens ``[start, end)`` of one request from ``src`` blocks
    into ``dst`` blocks, for the heads both sides hold, or for ``heads`` (global
    ids, all held by both sides: a TP route, ``transfer.tp``).

    Raises ValueError when the layouts cannot be copied byte for byte (a
    different dtype: plan from ``staging_layout`` instead) or a block table is
    too short, out of range or repeats a block.
    """
    if src.dtype != dst.dtype:
        raise ValueError(
            f"source dtype {src.dtype} != destination dtype {dst.dtype}: convert on the "
            f"sender and plan from staging_layout(src, {dst.dtype!r})"
        )
    if (src.num_layers, src.head_dim, src.num_kv_heads_total) != (dst.num_layers, dst.head_dim, dst.num_kv_heads_total):
        raise ValueError(f"layouts of different models: {src} vs {dst}")
    if not 0 <= start <= end:
        raise ValueError(f"bad token range [{start}, {end})")
    src_ids = src.check_block_ids(src_block_ids, end, "source block ids")
    dst_ids = dst.check_block_ids(dst_block_ids, end, "destination block ids")
    if heads is None:
        heads = common_heads(src, dst)
    else:
        heads = tuple(int(h) for h in heads)
        shared = set(common_heads(src, dst))
        if len(set(heads)) != len(heads) or not set(heads) <= shared:
            raise ValueError(f"heads {heads} are not distinct heads held by both sides ({sorted(shared)})")
    empty = np.zeros(0, dtype=np.int64)
    if start == end or not heads:
        return CopyPlan(empty, empty, empty, src.layer_bytes, dst.layer_bytes, heads)

    pos = np.arange(start, end, dtype=np.int64)
    kv = np.arange(2, dtype=np.int64)[:, None, None]
    src_h = src.local_head_index(heads)[None, None, :]
    dst_h = dst.local_head_index(heads)[None, None, :]
    tok = pos[None, :, None]
    src_off = src.vector_offsets(kv, src_ids[tok // src.block_size], tok % src.block_size, src_h)
    dst_off = dst.vector_offsets(kv, dst_ids[tok // dst.block_size], tok % dst.block_size, dst_h)
    src_off = src_off.reshape(-1)
    dst_off = dst_off.reshape(-1)
    order = np.argsort(src_off, kind="stable")
    return _merged(src_off[order], dst_off[order], src.vec_bytes, src, dst, heads)


def _merged(
    src_off: np.ndarray, dst_off: np.ndarray, vec: int, src: KVLayout, dst: KVLayout, heads: tuple[int, ...]
) -> CopyPlan:
    """Merge equal-length ranges that continue each other on both sides."""
    cont = (src_off[1:] == src_off[:-1] + vec) & (dst_off[1:] == dst_off[:-1] + vec)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    counts = np.diff(np.append(starts, len(src_off)))
    return CopyPlan(
        src_off[starts], dst_off[starts], counts.astype(np.int64) * vec, src.layer_bytes, dst.layer_bytes, heads
    )


def unit_mask(layout: KVLayout, block_ids) -> np.ndarray:
    """Per layer, which (kv, block) chunks of ``block_bytes`` belong to
    ``block_ids``; index a chunk by ``offset_in_layer // block_bytes``."""
    mask = np.zeros(2 * layout.num_blocks, dtype=bool)
    ids = np.asarray(block_ids, dtype=np.int64)
    for kv in (0, 1):
        mask[layout.chunk_offsets(kv, ids) // layout.block_bytes] = True
    return mask


def ranges_inside(layout: KVLayout, block_ids, offsets: np.ndarray, lengths: np.ndarray) -> bool:
    """True when every range lies inside one layer and only touches chunks of
    ``block_ids``: what a receiver checks before applying a sender's write."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(offsets) == 0:
        return True
    if (lengths <= 0).any() or offsets.min() < 0:
        return False
    last = offsets + lengths - 1
    if last.max() >= layout.total_bytes:
        return False
    layer = offsets // layout.layer_bytes
    if (last // layout.layer_bytes != layer).any():
        return False
    first_unit = (offsets - layer * layout.layer_bytes) // layout.block_bytes
    last_unit = (last - layer * layout.layer_bytes) // layout.block_bytes
    allowed = np.concatenate(([0], np.cumsum(unit_mask(layout, block_ids))))
    return bool((allowed[last_unit + 1] - allowed[first_unit] == last_unit - first_unit + 1).all())
