"""Gather and scatter byte ranges of a cache region (the sender's pack and the
receiver's unpack for message backends, and the in-memory apply of a plan).

CPU regions use numpy fancy indexing on rows of ``g`` bytes, ``g`` being the
gcd of all offsets and lengths (a head vector at least): measured ~19 GB/s
here, against ~2 GB/s for torch ``index_copy_`` on uint8. CUDA regions use
torch ``index_select`` / ``index_copy_`` on the same rows. A few large ranges
(merged runs) are copied slice by slice instead.
"""

from __future__ import annotations

import numpy as np
import torch

FEW_RANGES = 16


def region_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("a registered region must be one contiguous tensor")
    return tensor.reshape(-1).view(torch.uint8)


def _rows(offsets: np.ndarray, lengths: np.ndarray) -> tuple[int, np.ndarray]:
    """Row size g and the row indices that the ranges cover, in order."""
    g = int(np.gcd.reduce(np.concatenate((offsets, lengths))))
    counts = lengths // g
    first = offsets // g
    before = np.concatenate(([0], np.cumsum(counts)[:-1]))
    idx = np.repeat(first - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    return g, idx


def _row_view(flat, g: int):
    usable = (flat.shape[0] // g) * g
    return flat[:usable].reshape(-1, g)


def gather(
    region: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, out: np.ndarray | torch.Tensor | None = None
):
    """Concatenate the ranges of ``region`` (uint8 flat) into ``out``
    (allocated when None): numpy for CPU regions, torch on the device otherwise."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if region.is_cuda:
        if out is None:
            out = torch.empty(total, dtype=torch.uint8, device=region.device)
        if total:
            g, idx = _rows(offsets, lengths)
            rows = torch.from_numpy(idx).to(region.device)
            torch.index_select(_row_view(region, g), 0, rows, out=out[:total].view(-1, g))
        return out
    src = region.numpy()
    if out is None:
        out = np.empty(total, dtype=np.uint8)
    if len(offsets) <= FEW_RANGES:
        pos = 0
        for off, n in zip(offsets.tolist(), lengths.tolist()):
            out[pos : pos + n] = src[off : off + n]
            pos += n
    elif total:
        g, idx = _rows(offsets, lengths)
        np.take(_row_view(src, g), idx, axis=0, out=out[:total].reshape(-1, g))
    return out


def scatter(region: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, data) -> None:
    """Write the concatenated ``data`` (bytes-like, numpy or torch uint8) to
    the ranges of ``region`` (uint8 flat)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return
    if region.is_cuda:
        payload = (
            torch.as_tensor(np.frombuffer(data, dtype=np.uint8)[:total])
            if not isinstance(data, torch.Tensor)
            else data[:total]
        )
        payload = payload.to(region.device, non_blocking=True)
        g, idx = _rows(offsets, lengths)
        rows = torch.from_numpy(idx).to(region.device)
        _row_view(region, g).index_copy_(0, rows, payload.view(-1, g))
        return
    dst = region.numpy()
    src = data.numpy() if isinstance(data, torch.Tensor) else np.frombuffer(data, dtype=np.uint8)
    if len(src) < total:
        raise ValueError(f"payload has {len(src)} bytes, ranges need {total}")
    if len(offsets) <= FEW_RANGES:
        pos = 0
        for off, n in zip(offsets.tolist(), lengths.tolist()):
            dst[off : off + n] = src[pos : pos + n]
            pos += n
        return
    g, idx = _rows(offsets, lengths)
    _row_view(dst, g)[idx] = src[:total].reshape(-1, g)
