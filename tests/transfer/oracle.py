"""An independent reading of KV caches for tests: numpy views in the layout's
logical shape, never the byte-offset arithmetic under test."""

from __future__ import annotations

import numpy as np
import torch

from transfer.copy import gather, scatter
from transfer.layout import KVLayout


def logical(buf: np.ndarray, layout: KVLayout) -> np.ndarray:
    """View a flat uint8 cache as [L, kv, block, slot, head, vec_bytes]."""
    view = buf.reshape(*layout.shape[:-1], layout.vec_bytes)
    if layout.kv_fused:
        view = view.transpose(0, 2, 1, 3, 4, 5)
    if layout.order == "HND":
        view = view.transpose(0, 1, 2, 4, 3, 5)
    return view


def expected_after_copy(src_buf, src: KVLayout, src_ids, start, end, dst_buf, dst: KVLayout, dst_ids) -> np.ndarray:
    """What the destination must hold after copying tokens [start, end)."""
    out = dst_buf.copy()
    s_view, d_view = logical(src_buf, src), logical(out, dst)
    for h in src.head_ids:
        if h not in dst.head_ids:
            continue
        sh, dh = src.head_ids.index(h), dst.head_ids.index(h)
        for p in range(start, end):
            sb, ss = src_ids[p // src.block_size], p % src.block_size
            db, ds = dst_ids[p // dst.block_size], p % dst.block_size
            d_view[:, :, db, ds, dh] = s_view[:, :, sb, ss, sh]
    return out


def copy_ranges(src_region: torch.Tensor, dst_region: torch.Tensor, src_offsets, dst_offsets, lengths) -> None:
    """Apply one layer of a plan between two local regions, as a backend would."""
    scatter(dst_region, dst_offsets, lengths, gather(src_region, src_offsets, lengths))
