"""A server's KV transfer over its tensor-parallel ranks: one agent per rank, one outcome per request.

Rank 0's agent lives in the server process; rank r's in rank r's process
(server_common/tp_rank.py), driven by messages down its pipe (a server
without ranks has rank 0's alone).

``RankSenders`` is a prefill server's sender (``kv_port.KVSenderPort``):
``begin`` maps the prefill ranks' heads onto the decode group a reservation
names (``kv_target["tp"]``, or its one rank) with ``transfer.tp.rank_parts``
and starts every rank's parts, each an ordinary transfer with its own
checksum and lease; the layer hook pushes rank 0's parts layer by layer and
hands the other ranks their token ranges after the step (they push every
layer then, once their own forward wrote them); ``take_finished`` reports a
request's transfer once every part ended (``transfer.group.RankParts``),
with the first failed part's code after aborting the others.

``RankReceivers`` is a decode server's receiver (``kv_port.KVReceiverPort``):
``expect`` issues a transfer id on every rank (rank 0's is the request's) and
``target`` gives the reservation's ``kv_target["tp"]``; a request's transfer
ends once every rank's part ended, the others cancelled at the first failure.

The handshake is one per (prefill rank, decode rank) pair: each prefill rank
posts its hello to ``/kv/hello``, which every decode rank accepts and answers
(``kv_adapter.DecodePeers``). Engine thread: begin, push_layer, finish,
abort, expect, cancel, take_finished; any thread: the handshake.
"""

from __future__ import annotations

import base64
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from engine.tp_leader import RankProcesses
from transfer.group import RankParts
from transfer.layout import heads_for_rank
from transfer.messages import DecodeGroup, DecodeRank, group_to_target, single_rank
from transfer.outcome import Outcome, TransferEnded
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.tp import rank_parts


def rank_name(name: str, rank: int) -> str:
    """Rank r's agent name: the server's own for rank 0, ``<name>-r<rank>`` for the others."""
    return name if rank == 0 else f"{name}-r{rank}"


class _RankLink:
    """Rank 0's agent here, the others' through their pipes; ended parts fed into ``RankParts``."""

    def __init__(self, local, ranks: RankProcesses | None, timeout_s: float, notify) -> None:
        self._local = local
        self._ranks = ranks
        self.size = ranks.size if ranks is not None else 1
        self._notify = notify
        self._timeout_s = timeout_s
        first = local.layout
        total = first.num_kv_heads_total
        self.layouts = tuple(
            first.replace(head_ids=heads_for_rank(total, r, self.size), tp_rank=r) for r in range(self.size)
        )
        self._parts = RankParts()  # engine thread only
        self._single: set[str] = set()  # transfers of one part; engine thread only
        self._lock = threading.Lock()
        self._ended: list[tuple[int, TransferEnded]] = []  # from the ranks' answer threads
        self._waiting: dict[int, Future] = {}
        self._ids = itertools.count(1)
        if ranks is not None:
            ranks.listen(self._on_message)

    def _open_ranks(self, **message) -> None:
        for r in range(1, self.size):
            self._send(r, {"op": "open", **message, "name": rank_name(message["name"], r)})

    def start(self) -> None:
        self._local.start()

    def close(self) -> None:
        self._local.close()  # the other ranks' agents end with their processes

    def problem(self, stuck_after_s: float) -> str | None:
        return self._local.problem(stuck_after_s)

    def open_transfers(self) -> int:
        return len(self._parts)

    def _feed(self) -> list[tuple[TransferEnded | None, list[tuple[int, str]]]]:
        """Every part that ended since the last call: (the group's end or None, parts to stop). A
        transfer of one part (no tensor parallelism on either side) ends as that part did."""
        with self._lock:
            ended, self._ended = self._ended, []
        out = []
        for rank, e in [(0, e) for e in self._local.take_finished()] + ended:
            stop, group_end = self._parts.feed(rank, e)
            if group_end is not None and group_end.transfer_id in self._single:
                self._single.discard(group_end.transfer_id)
                group_end = e  # its own reason, not prefixed with a rank
            out.append((group_end, stop))
        return out

    def _send(self, rank: int, message: dict) -> None:
        """A message to a rank; a rank that is gone is the engine's problem (its step fails, /health
        says so and the server exits), so a broken pipe is not raised here a second time."""
        assert self._ranks is not None
        try:
            self._ranks.send_message(rank, message)
        except (BrokenPipeError, OSError):
            pass

    def _ask(self, rank: int, message: dict, timeout_s: float | None = None) -> dict:
        """A rank's answer to ``message``; RuntimeError with the rank's own when it failed."""
        assert self._ranks is not None
        fut: Future = Future()
        with self._lock:
            key = next(self._ids)
            self._waiting[key] = fut
        try:
            self._ranks.send_message(rank, {**message, "id": key})
            reply = fut.result(timeout_s or self._timeout_s)
        finally:
            with self._lock:
                self._waiting.pop(key, None)
        if "error" in reply:
            raise RuntimeError(f"rank {rank}: {reply['error']}")
        return reply

    def _on_message(self, rank: int, message: dict) -> None:
        if "ended" in message:
            tid, outcome, reason, first, at = message["ended"]
            e = TransferEnded(tid, Outcome(outcome), reason, tuple(first) if first is not None else None, at)
            with self._lock:
                self._ended.append((rank, e))
            if self._notify is not None:
                self._notify()
            return
        with self._lock:
            fut = self._waiting.get(message.get("id", -1))
        if fut is not None:
            fut.set_result(message)


class RankSenders(_RankLink):
    def __init__(
        self,
        local: KVSender,
        ranks: RankProcesses | None,
        *,
        name: str,
        model: str,
        backend: str,
        timeout_s: float,
        notify: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(local, ranks, timeout_s, notify)
        self._tids: dict[str, dict[int, list[str]]] = {}  # group -> rank -> its parts' transfer ids
        self._open_ranks(role="prefill", backend=backend, name=name, model=model, timeout_s=timeout_s)

    # -- handshake (any thread) ---------------------------------------------------
    def rank_hellos(self) -> list[bytes]:
        """Every rank's handshake message, rank 0 first."""
        hellos = [self._local.hello()]
        for r in range(1, self.size):
            hellos.append(base64.b64decode(self._ask(r, {"op": "hello"})["hello"]))
        return hellos

    def connect_ranks(self, answers: Sequence[Sequence[bytes]], timeout_s: float) -> list[list[str]]:
        """Rank r meets every decode rank that answered its hello (``answers[r]``); the names met."""
        met = [[self._local.connect(a, timeout_s) for a in answers[0]]]
        for r in range(1, self.size):
            names = []
            for a in answers[r]:
                message = {"op": "connect", "hello": base64.b64encode(a).decode(), "timeout_s": timeout_s}
                names.append(self._ask(r, message, timeout_s + self._timeout_s)["peer"])
            met.append(names)
        return met

    def forget(self, peer: str) -> None:
        self._local.forget(peer)
        for r in range(1, self.size):
            self._send(r, {"op": "forget", "peer": peer})

    # -- transfers (engine thread) ---------------------------------------------------
    def begin(
        self, transfer_id: str, peer: str, dst_block_ids: list[int], lease_s: float, target: DecodeGroup | None = None
    ) -> None:
        """Every rank's parts of a transfer into a reservation: ``target`` its decode group
        (``kv_target["tp"]``), None for a tp_size 1 decode server (``peer``, met by rank 0).
        Raises IncompatiblePeer before anything starts when the groups cannot exchange KV."""
        if target is None and self.size == 1:  # the plain transfer: every head both sides hold
            self._parts.open(transfer_id, [(0, transfer_id)])
            self._single.add(transfer_id)
            self._tids[transfer_id] = {0: [transfer_id]}
            self._local.begin(transfer_id, peer, dst_block_ids, lease_s)
            return
        if target is None:
            target = single_rank(transfer_id, peer, self._local.peer_layout(peer))
        parts = rank_parts(self.layouts, target)
        self._parts.open(transfer_id, [(r, p.transfer_id) for r, ps in parts.items() for p in ps])
        self._tids[transfer_id] = {r: [p.transfer_id for p in ps] for r, ps in parts.items() if ps}
        deadline = time.monotonic() + lease_s
        blocks = [int(b) for b in dst_block_ids]
        for r, ps in parts.items():
            for p in ps:
                if r == 0:
                    self._local.begin(p.transfer_id, p.peer, blocks, lease_s, p.heads)
                else:
                    message = {"tid": p.transfer_id, "peer": p.peer, "blocks": blocks, "heads": list(p.heads)}
                    self._send(r, {"op": "begin", "deadline": deadline, **message})

    def push_layer(self, transfer_id: str, layer: int, src_block_ids: list[int], start: int, end: int) -> None:
        for r, tids in self._tids.get(transfer_id, {}).items():
            for tid in tids:
                if r == 0:
                    self._local.push_layer(tid, layer, src_block_ids, start, end)
                elif layer == 0:  # handled after this step, once the rank's forward wrote every layer
                    message = {"tid": tid, "blocks": [int(b) for b in src_block_ids], "start": start, "end": end}
                    self._send(r, {"op": "push", **message})

    def finish(self, transfer_id: str, first_tokens: Sequence[int]) -> None:
        first = [int(t) for t in first_tokens]
        for r, tids in self._tids.get(transfer_id, {}).items():
            for tid in tids:
                if r == 0:
                    self._local.finish(tid, first)
                else:
                    self._send(r, {"op": "finish", "tid": tid, "first": first})

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
            self._local.abort(tid)
        else:
            self._send(rank, {"op": "abort", "tid": tid})


class RankReceivers(_RankLink):
    def __init__(
        self,
        local: KVReceiver,
        ranks: RankProcesses,
        *,
        name: str,
        model: str,
        backend: str,
        timeout_s: float,
        host: str,
        advertise: str,
        notify: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(local, ranks, timeout_s, notify)
        self._name = name
        self._targets: dict[str, dict] = {}  # group -> its kv_target["tp"]; engine thread only
        message = {"backend": backend, "name": name, "model": model, "timeout_s": timeout_s}
        self._open_ranks(role="decode", host=host, advertise=advertise, **message)

    def accept(self, sender_hello: bytes, timeout_s: float) -> bytes:
        """Rank 0's answer (``accept_ranks`` has every rank's)."""
        return self.accept_ranks(sender_hello, timeout_s)[0]

    def accept_ranks(self, sender_hello: bytes, timeout_s: float) -> list[bytes]:
        """Every rank meets a prefill rank; their answers in rank order. Any thread."""
        answers = [self._local.accept(sender_hello, timeout_s)]
        for r in range(1, self.size):
            message = {"op": "accept", "hello": base64.b64encode(sender_hello).decode(), "timeout_s": timeout_s}
            answers.append(base64.b64decode(self._ask(r, message, timeout_s + self._timeout_s)["hello"]))
        return answers

    def expect(self, block_ids: list[int], lease_s: float, writable_from: int = 0) -> str:
        # rank 0 checks the block ids and range first: every rank has the same blocks, so none fails after it
        blocks = [int(b) for b in block_ids]
        tids = [self._local.expect(blocks, lease_s, writable_from=writable_from)]
        try:
            for r in range(1, self.size):
                message = {"op": "expect", "blocks": blocks, "lease_s": lease_s, "writable_from": writable_from}
                tids.append(self._ask(r, message)["tid"])
        except BaseException:
            for r, tid in enumerate(tids):
                self._cancel_part(r, tid, "reservation failed")
            raise
        self._parts.open(tids[0], list(enumerate(tids)))
        ranks = tuple(DecodeRank(r, rank_name(self._name, r), tid, self.layouts[r]) for r, tid in enumerate(tids))
        self._targets[tids[0]] = group_to_target(DecodeGroup(self.size, ranks))
        return tids[0]

    def target(self, transfer_id: str) -> dict:
        """The reservation's ``kv_target["tp"]`` for a transfer ``expect`` issued."""
        return self._targets[transfer_id]

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        for r, tid in self._parts.stop(transfer_id):
            self._cancel_part(r, tid, reason)

    def take_finished(self) -> list[TransferEnded]:
        out = []
        for group_end, stop in self._feed():
            for r, tid in stop:
                self._cancel_part(r, tid, "another rank's part failed")
            if group_end is not None:
                self._targets.pop(group_end.transfer_id, None)
                out.append(group_end)
        return out

    def counters(self) -> dict[str, int]:
        return self._local.counters()

    def _cancel_part(self, rank: int, tid: str, reason: str) -> None:
        if rank == 0:
            self._local.cancel(tid, reason)
        else:
            self._send(rank, {"op": "cancel", "tid": tid, "reason": reason})
