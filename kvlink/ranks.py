"""A server's KV transfer over its ranks: one agent per rank, one outcome per request.

Every server is a group of ranks, one at tp_size 1. Rank 0's agent lives in
the server process; rank r's in rank r's process (``kvlink.agent``), driven
by ``kvlink.messages`` down its pipe.

``RankSenders`` is a prefill server's sender (``ports.KVSenderPort``):
``begin`` maps the prefill ranks' heads onto the decode group of the route
(``transfer.tp.rank_parts``) and starts every rank's parts, each an ordinary
transfer with its own checksum and lease; the layer hook pushes rank 0's
parts layer by layer and sends the other ranks each layer's token range as
it goes, which they take after the step, once their own forward wrote it
(a window layer's range may start later than a full layer's);
``take_finished`` reports a request's transfer once every part ended
(``transfer.group.RankParts``), with the first failed part's code after
aborting the others.

``RankReceivers`` is a decode server's receiver (``ports.KVReceiverPort``):
``expect`` issues a transfer id on every rank (rank 0's is the request's)
and says where to write (``wire.kv_target.KVTarget``, its group when it has
more than one rank); a request's transfer ends once every rank's part ended,
the others cancelled at the first failure.

A transfer of one part (one rank on each side, or one prefill rank holding
every head a decode rank of one needs) ends as its part did: its own reason,
not one naming a rank. The handshake is one per (prefill rank, decode rank)
pair: each prefill rank posts its hello to ``/kv/hello``, which every decode
rank accepts and answers (``kvlink.peers``). Engine thread: begin,
push_layer, finish, abort, expect, cancel, take_finished; any thread: the
handshake.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import msgspec

from engine.tp_leader import RankProcesses
from kvlink.messages import (
    Abort,
    Accept,
    Answer,
    AskHello,
    Asking,
    Begin,
    CancelPart,
    Connect,
    Expect,
    Finish,
    Forget,
    Open,
    PartEnded,
    Push,
    ToRank,
    from_rank,
    to_pipe,
)
from kvlink.ports import Expected, Notify, Route
from transfer.group import RankParts
from transfer.layout import KVLayout
from transfer.messages import DecodeGroup, DecodeRank
from transfer.outcome import Outcome, TransferEnded
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.tp import rank_parts
from wire.kv_target import KVTarget


def rank_name(name: str, rank: int) -> str:
    """Rank r's agent name: the server's own for rank 0, ``<name>-r<rank>`` for the others."""
    return name if rank == 0 else f"{name}-r{rank}"


class _RankLink:
    """Rank 0's agent here, the others' through their pipes; ended parts fed into ``RankParts``."""

    def __init__(
        self, local: KVSender | KVReceiver, ranks: RankProcesses | None, opening: Open, notify: Notify | None
    ) -> None:
        self._local = local
        self._ranks = ranks
        self.size = ranks.size if ranks is not None else 1
        self._notify = notify
        self._timeout_s = opening.timeout_s
        self._parts = RankParts()  # engine thread only
        self._single: set[str] = set()  # transfers of one part; engine thread only
        self._lock = threading.Lock()
        self._ended: list[tuple[int, TransferEnded]] = []  # from the ranks' answer threads
        self._waiting: dict[int, Future] = {}
        self._ids = itertools.count(1)
        layouts: list[KVLayout] = [local.layout]
        if ranks is not None:
            ranks.listen(self._on_message)
            for r in range(1, self.size):
                layout = self._ask(r, _with_name(opening, rank_name(opening.name, r))).layout
                assert layout is not None
                layouts.append(layout)
        self.layouts = tuple(layouts)  # each rank's, as its agent reported it

    def start(self) -> None:
        self._local.start()

    def close(self) -> None:
        self._local.close()  # the other ranks' agents end with their processes

    def problem(self, stuck_after_s: float) -> str | None:
        return self._local.problem(stuck_after_s)

    def open_transfers(self) -> int:
        return len(self._parts)

    def _open(self, transfer_id: str, parts: list[tuple[int, str]]) -> None:
        self._parts.open(transfer_id, parts)
        if len(parts) == 1:
            self._single.add(transfer_id)

    def _feed(self) -> list[tuple[TransferEnded | None, list[tuple[int, str]]]]:
        """Every part that ended since the last call: (the group's end or None, parts to stop)."""
        with self._lock:
            ended, self._ended = self._ended, []
        out = []
        for rank, e in [(0, e) for e in self._local.take_finished()] + ended:
            stop, group_end = self._parts.feed(rank, e)
            if group_end is not None and group_end.transfer_id in self._single:
                self._single.discard(group_end.transfer_id)
                group_end = TransferEnded(group_end.transfer_id, e.outcome, e.reason, e.first_tokens, e.at)
            out.append((group_end, stop))
        return out

    def _send(self, rank: int, message: ToRank) -> None:
        """A message to a rank; a rank that is gone is the engine's problem (its step fails, /health
        says so and the server exits), so a broken pipe is not raised here a second time."""
        assert self._ranks is not None
        try:
            self._ranks.send_message(rank, to_pipe(message))
        except (BrokenPipeError, OSError):
            pass

    def _ask(self, rank: int, message: Asking, timeout_s: float | None = None) -> Answer:
        """A rank's answer to ``message`` (its ``id`` is set here); RuntimeError with the rank's own
        when it failed."""
        assert self._ranks is not None
        fut: Future = Future()
        with self._lock:
            key = next(self._ids)
            self._waiting[key] = fut
        try:
            self._ranks.send_message(rank, {**to_pipe(message), "id": key})
            answer: Answer = fut.result(timeout_s or self._timeout_s)
        finally:
            with self._lock:
                self._waiting.pop(key, None)
        if answer.error:
            raise RuntimeError(f"rank {rank}: {answer.error}")
        return answer

    def _on_message(self, rank: int, raw: dict) -> None:
        message = from_rank(raw)
        if isinstance(message, PartEnded):
            e = TransferEnded(message.tid, Outcome(message.outcome), message.reason, message.first_tokens, message.at)
            with self._lock:
                self._ended.append((rank, e))
            if self._notify is not None:
                self._notify()
            return
        with self._lock:
            fut = self._waiting.get(message.id)
        if fut is not None:
            fut.set_result(message)


def _with_name(opening: Open, name: str) -> Open:
    return msgspec.structs.replace(opening, name=name)


class RankSenders(_RankLink):
    def __init__(self, local: KVSender, ranks: RankProcesses | None, opening: Open, notify: Notify | None = None):
        super().__init__(local, ranks, opening, notify)
        self._sender = local
        self._tids: dict[str, dict[int, list[str]]] = {}  # group -> rank -> its parts' transfer ids

    # -- handshake (any thread) ---------------------------------------------------
    def rank_hellos(self) -> list[bytes]:
        """Every rank's handshake message, rank 0 first."""
        return [self._sender.hello()] + [self._ask(r, AskHello(0)).hello for r in range(1, self.size)]

    def connect_ranks(self, answers: Sequence[Sequence[bytes]], timeout_s: float) -> list[list[str]]:
        """Rank r meets every decode rank that answered its hello (``answers[r]``); the names met."""
        met = [[self._sender.connect(a, timeout_s) for a in answers[0]]]
        for r in range(1, self.size):
            met.append([self._ask(r, Connect(0, a, timeout_s), timeout_s + self._timeout_s).peer for a in answers[r]])
        return met

    def peer_layout(self, peer: str) -> KVLayout:
        """The layout the decode agent ``peer`` answered rank 0's handshake with."""
        return self._sender.peer_layout(peer)

    def forget(self, peer: str) -> None:
        self._sender.forget(peer)
        for r in range(1, self.size):
            self._send(r, Forget(peer))

    # -- transfers (engine thread) ---------------------------------------------------
    def begin(self, route: Route, lease_s: float) -> None:
        """Every rank's parts of a transfer into a reservation's decode group. Raises
        IncompatiblePeer before anything starts when the groups cannot exchange KV."""
        tid = route.transfer_id
        parts = rank_parts(self.layouts, route.group)
        self._open(tid, [(r, p.transfer_id) for r, ps in parts.items() for p in ps])
        self._tids[tid] = {r: [p.transfer_id for p in ps] for r, ps in parts.items() if ps}
        deadline = time.monotonic() + lease_s
        blocks = list(route.block_ids)
        for r, ps in parts.items():
            for p in ps:
                if r == 0:
                    self._sender.begin(p.transfer_id, p.peer, blocks, lease_s, p.heads)
                else:
                    self._send(r, Begin(p.transfer_id, p.peer, blocks, deadline, p.heads))

    def push_layer(self, transfer_id: str, layer: int, src_block_ids: list[int], start: int, end: int) -> None:
        for r, tids in self._tids.get(transfer_id, {}).items():
            for tid in tids:
                if r == 0:
                    self._sender.push_layer(tid, layer, src_block_ids, start, end)
                else:  # the rank takes it after this step, once its own forward wrote the layer
                    self._send(r, Push(tid, layer, [int(b) for b in src_block_ids], start, end))

    def finish(self, transfer_id: str, first_tokens: Sequence[int]) -> None:
        first = [int(t) for t in first_tokens]
        for r, tids in self._tids.get(transfer_id, {}).items():
            for tid in tids:
                if r == 0:
                    self._sender.finish(tid, first)
                else:
                    self._send(r, Finish(tid, first))

    def abort(self, transfer_id: str) -> None:
        for r, tid in self._parts.stop(transfer_id):
            self._abort_part(r, tid)

    def take_finished(self) -> list[TransferEnded]:
        out = []
        for group_end, stop in self._feed():
            for r, tid in stop:
                self._abort_part(r, tid)
            if group_end is not None:
                self._tids.pop(group_end.transfer_id, None)
                out.append(group_end)
        return out

    def _abort_part(self, rank: int, tid: str) -> None:
        if rank == 0:
            self._sender.abort(tid)
        else:
            self._send(rank, Abort(tid))


class RankReceivers(_RankLink):
    def __init__(self, local: KVReceiver, ranks: RankProcesses | None, opening: Open, notify: Notify | None = None):
        super().__init__(local, ranks, opening, notify)
        self._receiver = local
        self._name = opening.name
        # In every reservation: a prefill server that sees a new epoch (this server restarted) meets it afresh.
        self._epoch = secrets.token_hex(8)

    def accept(self, sender_hello: bytes, timeout_s: float) -> list[bytes]:
        """Every rank meets a prefill rank; their answers in rank order. Any thread."""
        answers = [self._receiver.accept(sender_hello, timeout_s)]
        for r in range(1, self.size):
            answers.append(self._ask(r, Accept(0, sender_hello, timeout_s), timeout_s + self._timeout_s).hello)
        return answers

    def expect(self, block_ids: list[int], lease_s: float, writable_from: int = 0) -> Expected:
        # rank 0 checks the block ids and range first: every rank has the same blocks, so none fails after it
        blocks = [int(b) for b in block_ids]
        tids = [self._receiver.expect(blocks, lease_s, writable_from=writable_from)]
        try:
            for r in range(1, self.size):
                tids.append(self._ask(r, Expect(0, blocks, lease_s, writable_from)).tid)
        except BaseException:
            for r, tid in enumerate(tids):
                self._cancel_part(r, tid, "reservation failed")
            raise
        self._open(tids[0], list(enumerate(tids)))
        group = None
        if self.size > 1:
            ranks = tuple(DecodeRank(r, rank_name(self._name, r), tid, self.layouts[r]) for r, tid in enumerate(tids))
            group = DecodeGroup(self.size, ranks)
        return Expected(tids[0], KVTarget(peer=self._name, epoch=self._epoch, tp=group))

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        for r, tid in self._parts.stop(transfer_id):
            self._cancel_part(r, tid, reason)

    def take_finished(self) -> list[TransferEnded]:
        out = []
        for group_end, stop in self._feed():
            for r, tid in stop:
                self._cancel_part(r, tid, "another rank's part failed")
            if group_end is not None:
                out.append(group_end)
        return out

    def counters(self) -> dict[str, int]:
        return self._receiver.counters()

    def _cancel_part(self, rank: int, tid: str, reason: str) -> None:
        if rank == 0:
            self._receiver.cancel(tid, reason)
        else:
            self._send(rank, CancelPart(tid, reason))
