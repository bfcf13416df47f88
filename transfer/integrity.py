"""Transfer ids, leases and checksums: what a receiver trusts before it
accepts KV into blocks it reserved.

* The receiver issues every transfer id when it reserves blocks. A write or
  notice for an id it does not know (never issued, or already ended: completed,
  failed, expired) is dropped and counted, never applied.
* The completion notice carries a CRC32 of what was sent: the K/V vectors of
  the tokens in a sample of destination blocks (first, last and a few chosen by
  the transfer id; ``checksum="all"`` for every block), all layers, in the
  canonical order (layer, kv, token, head) so both sides compute it from their
  own layout; a layer sent from a later token (``Done.layer_starts``: a
  sliding-window layer) only over the positions it sent. The receiver
  recomputes it from its cache before accepting.
"""

from __future__ import annotations

import secrets
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from transfer.layout import KVLayout
from transfer.messages import Done
from transfer.outcome import Outcome

CHECKSUM_MODES = ("sampled", "all", "none")


@dataclass
class Expected:
    """A reservation waiting for remote KV."""

    transfer_id: str
    block_ids: tuple[int, ...]
    deadline: float  # time.monotonic()
    done: dict[str, Done] = field(default_factory=dict)  # sending peer -> its verified notice
    senders_seen: set[str] = field(default_factory=set)
    cancel_reason: str | None = None  # set once a cancel was sent to the senders
    cancel_code: Outcome = Outcome.CANCELLED  # how it ends once the senders confirmed
    cancel_deadline: float = 0.0
    writable_from: int = 0  # writes may touch block_ids[writable_from:] only (the rest is a shared cached prefix)

    def heads_arrived(self) -> set[int]:
        """Global KV heads covered by the verified notices so far."""
        return {h for done in self.done.values() for h in done.heads}

    @property
    def cancelling(self) -> bool:
        return self.cancel_reason is not None


class IssuedTransfers:
    """Ids issued by this receiver, their leases, and what was dropped."""

    def __init__(self, name: str, remember: int = 4096) -> None:
        self._name = name
        self._active: dict[str, Expected] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> how it ended
        self._remember = remember
        self.counters = {
            "issued": 0,
            "completed": 0,
            "failed": 0,
            "dropped_unknown": 0,
            "dropped_expired": 0,
            "checksum_failures": 0,
        }

    def issue(self, block_ids, lease_s: float, now: float | None = None, writable_from: int = 0) -> str:
        if lease_s <= 0:
            raise ValueError(f"lease_s={lease_s} must be positive")
        tid = f"{self._name}-{secrets.token_hex(8)}"
        now = time.monotonic() if now is None else now
        self._active[tid] = Expected(tid, tuple(int(b) for b in block_ids), now + lease_s, writable_from=writable_from)
        self.counters["issued"] += 1
        return tid

    def __len__(self) -> int:
        """Transfer ids issued and not ended."""
        return len(self._active)

    def live(self, transfer_id: str) -> Expected | None:
        """The reservation of a transfer id not ended yet, or None."""
        return self._active.get(transfer_id)

    def count_drop(self, transfer_id: str) -> None:
        """A write or notice for an id that is not live was dropped: counted as expired (it ended) or unknown."""
        self.counters["dropped_expired" if transfer_id in self._ended else "dropped_unknown"] += 1

    def end(self, transfer_id: str, ok: bool) -> None:
        if self._active.pop(transfer_id, None) is None:
            return
        self.counters["completed" if ok else "failed"] += 1
        self._ended[transfer_id] = "completed" if ok else "failed"
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)

    def overdue(self, now: float) -> list[Expected]:
        """Reservations past their lease and not yet being cancelled."""
        return [e for e in self._active.values() if not e.cancelling and now >= e.deadline]

    def being_cancelled(self) -> list[Expected]:
        return [e for e in self._active.values() if e.cancelling]

    def active(self) -> list[Expected]:
        return list(self._active.values())


def checksum_positions(
    transfer_id: str, dst_block_size: int, start: int, end: int, mode: str, sample_blocks: int = 4
) -> np.ndarray:
    """Token positions covered by the checksum, chosen in destination blocks
    (the same on both sides: only the id, the range and the block size)."""
    if mode not in CHECKSUM_MODES:
        raise ValueError(f"checksum mode {mode!r} is not one of {CHECKSUM_MODES}")
    if mode == "none" or start >= end:
        return np.zeros(0, dtype=np.int64)
    first, last = start // dst_block_size, (end - 1) // dst_block_size
    blocks = np.arange(first, last + 1)
    if mode == "sampled" and len(blocks) > sample_blocks:
        rng = np.random.default_rng(zlib.crc32(transfer_id.encode()))
        middle = rng.choice(blocks[1:-1], size=max(sample_blocks - 2, 0), replace=False)
        blocks = np.unique(np.concatenate(([first, last], middle)))
    pos = (blocks[:, None] * dst_block_size + np.arange(dst_block_size)[None, :]).reshape(-1)
    return pos[(pos >= start) & (pos < end)].astype(np.int64)


def kv_checksum(
    region: torch.Tensor,
    layout: KVLayout,
    block_ids,
    positions: np.ndarray,
    heads: tuple[int, ...],
    layer_starts: Sequence[int] = (),
) -> int:
    """CRC32 of the K/V vectors at ``positions`` for global ``heads``, all
    layers, canonical order; ``region`` is the cache as flat uint8.
    ``layer_starts`` (one per layer, or empty): layer l's positions before
    ``layer_starts[l]`` are left out."""
    if len(positions) == 0 or not heads:
        return 0
    if layer_starts:
        assert len(layer_starts) == layout.num_layers, (len(layer_starts), layout.num_layers)
    ids = np.asarray(block_ids, dtype=np.int64)
    tok = positions[None, None, :, None]
    kv = np.arange(2)[None, :, None, None]
    layer = np.arange(layout.num_layers)[:, None, None, None]
    offsets = layout.vector_offsets(
        kv, ids[tok // layout.block_size], tok % layout.block_size, layout.local_head_index(heads)[None, None, None, :]
    )
    offsets = offsets + layer * layout.layer_bytes
    if layer_starts:  # keep (layer, token) pairs at or past the layer's start, in canonical order
        kept = positions[None, :] >= np.asarray(layer_starts, dtype=np.int64)[:, None]
        offsets = offsets[np.broadcast_to(kept[:, None, :, None], offsets.shape)]
        if len(offsets) == 0:
            return 0
    rows = (offsets.reshape(-1) // layout.vec_bytes).astype(np.int64)
    table = region[: layout.total_bytes].view(-1, layout.vec_bytes)
    if table.is_cuda:
        picked = table.index_select(0, torch.from_numpy(rows).to(table.device)).cpu().numpy()
    else:  # numpy's take is ~40x faster than torch index_select on uint8 rows
        picked = np.take(table.numpy(), rows, axis=0)
    return zlib.crc32(picked)
