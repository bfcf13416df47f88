"""One transfer across TP ranks: per-rank parts, one outcome.

A TP instance moves a request's KV as several parts, each an ordinary
transfer of one rank's ``KVSender`` or ``KVReceiver`` with its own transfer
id, checksum and lease (``transfer.tp`` says which heads go where). The
instance's leader (the process with the scheduler) sees one transfer:

    rank parts (each rank's take_finished)      leader (RankParts)
    (rank 0, tid a) ok ──────────────────────▶  wait for every part
    (rank 1, tid b) lease_expired ───────────▶  first failure: stop the others
                                                (cancel on D, abort on P), then
    (rank 0, tid c) cancelled ───────────────▶  the group ends lease_expired,
                                                once every part has ended

A group ends only when every part ended, so no rank can still be writing
(P) or be written into (D) when the leader frees the request's blocks. It
completes only if every part completed with the same first tokens; else it
ends with the first failed part's code, the reason naming the rank.

``RankParts`` is the bookkeeping alone (no threads, no I/O): a leader whose
ranks live in other processes feeds it the ``TransferEnded`` each rank
reports. ``ReceiverGroup`` and ``SenderGroup`` put it over ranks held in
this process (tests, benchmarks, a one-process TP instance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transfer.layout import KVLayout
from transfer.messages import DecodeGroup, DecodeRank
from transfer.outcome import Outcome, TransferEnded
from transfer.tp import check_group, rank_parts

PartKey = tuple[int, str]  # (rank, the part's transfer id on that rank)


@dataclass
class _Group:
    group_id: str
    running: set[PartKey]
    ended: dict[PartKey, TransferEnded] = field(default_factory=dict)
    failure: TransferEnded | None = None


class RankParts:
    """Which rank parts make each group transfer, and when the group has ended."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[PartKey, str] = {}

    def open(self, group_id: str, parts: Sequence[PartKey]) -> None:
        if group_id in self._groups:
            raise ValueError(f"transfer {group_id!r} is already open")
        if not parts or len(set(parts)) != len(parts) or any(p in self._group_of for p in parts):
            raise ValueError(f"transfer {group_id!r}: parts {list(parts)} are empty, repeat or belong to another")
        self._groups[group_id] = _Group(group_id, set(parts))
        self._group_of.update(dict.fromkeys(parts, group_id))

    def feed(self, rank: int, ended: TransferEnded) -> tuple[list[PartKey], TransferEnded | None]:
        """One rank reported a part ended. Returns (the parts still running that
        must now be stopped: once, at the group's first failure; the group's end
        once its last part ended, else None). A part of no open group is ignored."""
        key = (rank, ended.transfer_id)
        group_id = self._group_of.pop(key, None)
        if group_id is None:
            return [], None
        group = self._groups[group_id]
        group.running.discard(key)
        group.ended[key] = ended
        stop: list[PartKey] = []
        if not ended.ok and group.failure is None:
            stop = sorted(group.running)
            reason = f"rank {rank}: {ended.reason}" if ended.reason else f"rank {rank}"
            group.failure = TransferEnded(group_id, ended.outcome, reason, None, ended.at)
        if group.running:
            return stop, None
        del self._groups[group_id]
        return stop, self._outcome(group, ended.at)

    def stop(self, group_id: str) -> list[PartKey]:
        """The parts of ``group_id`` still running (to cancel or abort them all)."""
        group = self._groups.get(group_id)
        return sorted(group.running) if group is not None else []

    def __len__(self) -> int:
        """Groups not ended yet."""
        return len(self._groups)

    @staticmethod
    def _outcome(group: _Group, at: float) -> TransferEnded:
        if group.failure is not None:
            return group.failure
        firsts = {e.first_tokens for e in group.ended.values()}
        if len(firsts) > 1:
            reason = f"ranks disagree on the first tokens: {sorted(firsts, key=str)}"
            return TransferEnded(group.group_id, Outcome.BAD_NOTICE, reason, None, at)
        return TransferEnded(group.group_id, Outcome.OK, "", firsts.pop(), at)


class ReceiverGroup:
    """The decode side of a TP instance: one ``KVReceiver`` per rank, one block table.

    ``expect`` issues a transfer id on every rank and returns the group id
    (rank 0's id: a tp_size 1 group is an ordinary transfer) and the
    ``DecodeGroup`` for the reservation's ``kv_target["tp"]``."""

    def __init__(self, receivers: Sequence) -> None:
        self.ranks = list(receivers)
        self.layouts: tuple[KVLayout, ...] = check_group([r.layout for r in self.ranks], "decode")
        self._parts = RankParts()

    def expect(self, block_ids, lease_s: float, writable_from: int = 0) -> tuple[str, DecodeGroup]:
        # rank 0 checks the block ids and range first: every rank has the same blocks, so none fails after it
        tids = [self.ranks[0].expect(block_ids, lease_s, writable_from=writable_from)]
        tids += [r.expect(block_ids, lease_s, writable_from=writable_from) for r in self.ranks[1:]]
        self._parts.open(tids[0], list(enumerate(tids)))
        ranks = tuple(DecodeRank(r, rx.name, tid, rx.layout) for r, (rx, tid) in enumerate(zip(self.ranks, tids)))
        return tids[0], DecodeGroup(len(ranks), ranks)

    def cancel(self, group_id: str, reason: str = "cancelled") -> None:
        """Stop waiting on every rank; ``take_finished`` reports the group once all confirmed."""
        for rank, tid in self._parts.stop(group_id):
            self.ranks[rank].cancel(tid, reason)

    def take_finished(self) -> list[TransferEnded]:
        out = []
        for rank, receiver in enumerate(self.ranks):
            for ended in receiver.take_finished():
                stop, group_end = self._parts.feed(rank, ended)
                for other, tid in stop:
                    self.ranks[other].cancel(tid, f"rank {rank} failed: {ended.outcome}")
                if group_end is not None:
                    out.append(group_end)
        return out

    def counters(self) -> list[dict[str, int]]:
        """Each rank's receiver counters."""
        return [r.counters() for r in self.ranks]

    def open_transfers(self) -> int:
        return len(self._parts)


class SenderGroup:
    """The prefill side of a TP instance: one ``KVSender`` per rank, each meeting
    every decode rank it sends to (``KVSender.connect``, per pair)."""

    def __init__(self, senders: Sequence) -> None:
        self.ranks = list(senders)
        self.layouts: tuple[KVLayout, ...] = check_group([s.layout for s in self.ranks], "prefill")
        self._parts = RankParts()
        self._tids: dict[str, dict[int, list[str]]] = {}  # group -> rank -> its parts' transfer ids

    def begin(self, group_id: str, target: DecodeGroup, dst_block_ids, lease_s: float) -> None:
        """Start every rank's parts of the transfer a reservation describes
        (``transfer.messages.parse_group``, or ``single_rank`` for a tp_size 1
        decode server). Raises IncompatiblePeer before anything starts when the
        groups cannot exchange KV."""
        parts = rank_parts(self.layouts, target)
        keys = [(rank, part.transfer_id) for rank, ps in parts.items() for part in ps]
        self._parts.open(group_id, keys)
        self._tids[group_id] = {rank: [p.transfer_id for p in ps] for rank, ps in parts.items()}
        for rank, ps in parts.items():
            for part in ps:
                self.ranks[rank].begin(part.transfer_id, part.peer, dst_block_ids, lease_s, part.heads)

    def push_layer(self, group_id: str, layer: int, src_block_ids, start: int, end: int) -> None:
        """Each rank queues ``layer`` for every decode rank it sends to (a rank's own layer hook in an engine)."""
        for rank, tids in self._tids.get(group_id, {}).items():
            for tid in tids:
                self.ranks[rank].push_layer(tid, layer, src_block_ids, start, end)

    def finish(self, group_id: str, first_tokens: Sequence[int]) -> None:
        for rank, tids in self._tids.get(group_id, {}).items():
            for tid in tids:
                self.ranks[rank].finish(tid, first_tokens)

    def abort(self, group_id: str) -> None:
        for rank, tid in self._parts.stop(group_id):
            self.ranks[rank].abort(tid)

    def take_finished(self) -> list[TransferEnded]:
        out = []
        for rank, sender in enumerate(self.ranks):
            for ended in sender.take_finished():
                stop, group_end = self._parts.feed(rank, ended)
                for other, tid in stop:
                    self.ranks[other].abort(tid)
                if group_end is not None:
                    self._tids.pop(group_end.transfer_id, None)
                    out.append(group_end)
        return out

    def open_transfers(self) -> int:
        return len(self._parts)
