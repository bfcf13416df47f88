"""A tensor-parallel prefill server's KV sender: one ``KVSender`` per rank, one outcome per request.

Rank 0's sender lives in the server process; rank r's in rank r's process
(server_common/tp_rank.py), driven by messages down its pipe. To the prefill
service this is one sender (``kv_port.KVSenderPort``): ``begin`` maps the
prefill ranks' heads onto the decode server's (``transfer.tp.rank_parts``)
and starts every rank's parts, each an ordinary transfer with its own
checksum and lease; the layer hook pushes rank 0's parts layer by layer and
hands the other ranks their token ranges after the step (they push every
layer then, once their own forward wrote them); ``take_finished`` reports a
request's transfer once every part ended (``transfer.group.RankParts``),
with the first failed part's code after aborting the others.

The handshake is one per (prefill rank, decode rank) pair: ``rank_hellos``
and ``connect_ranks`` (``kv_adapter.DecodePeers``). Engine thread: begin,
push_layer, finish, abort, take_finished; any thread: the handshake.
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
from transfer.messages import single_rank
from transfer.outcome import Outcome, TransferEnded
from transfer.sender import KVSender
from transfer.tp import rank_parts


def rank_name(name: str, rank: int) -> str:
    """Rank r's agent name: the server's own for rank 0, ``<name>-r<rank>`` for the others."""
    return name if rank == 0 else f"{name}-r{rank}"


class RankSenders:
    def __init__(
        self,
        local: KVSender,
        ranks: RankProcesses,
        *,
        name: str,
        model: str,
        backend: str,
        timeout_s: float,
        notify: Callable[[], None] | None = None,
    ) -> None:
        self._local = local
        self._ranks = ranks
        self._notify = notify
        self._timeout_s = timeout_s
        first = local.layout
        total = first.num_kv_heads_total
        self.layouts = tuple(
            first.replace(head_ids=heads_for_rank(total, r, ranks.size), tp_rank=r) for r in range(ranks.size)
        )
        self._parts = RankParts()  # engine thread only
        self._tids: dict[str, dict[int, list[str]]] = {}  # group -> rank -> its parts' transfer ids
        self._lock = threading.Lock()
        self._ended: list[tuple[int, TransferEnded]] = []  # from the ranks' answer threads
        self._waiting: dict[int, Future] = {}
        self._ids = itertools.count(1)
        ranks.listen(self._on_message)
        for r in range(1, ranks.size):
            ranks.send_message(
                r,
                {"op": "open", "backend": backend, "name": rank_name(name, r), "model": model, "timeout_s": timeout_s},
            )

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        self._local.start()

    def close(self) -> None:
        self._local.close()  # the other ranks' senders end with their processes

    def problem(self, stuck_after_s: float) -> str | None:
        return self._local.problem(stuck_after_s)

    # -- handshake (any thread) ---------------------------------------------------
    def rank_hellos(self) -> list[bytes]:
        """Every rank's handshake message, rank 0 first."""
        hellos = [self._local.hello()]
        for r in range(1, self._ranks.size):
            hellos.append(base64.b64decode(self._ask(r, {"op": "hello"})["hello"]))
        return hellos

    def connect_ranks(self, answers: Sequence[bytes], timeout_s: float) -> list[str]:
        """Rank r meets the decode rank that answered its hello with ``answers[r]``; the names met."""
        peers = [self._local.connect(answers[0], timeout_s)]
        for r in range(1, self._ranks.size):
            message = {"op": "connect", "hello": base64.b64encode(answers[r]).decode(), "timeout_s": timeout_s}
            reply = self._ask(r, message, timeout_s + self._timeout_s)
            if "error" in reply:
                raise RuntimeError(f"prefill rank {r}: {reply['error']}")
            peers.append(reply["peer"])
        return peers

    def forget(self, peer: str) -> None:
        self._local.forget(peer)
        for r in range(1, self._ranks.size):
            self._send(r, {"op": "forget", "peer": peer})

    # -- transfers (engine thread) ---------------------------------------------------
    def begin(self, transfer_id: str, peer: str, dst_block_ids: list[int], lease_s: float) -> None:
        """Every rank's parts of a transfer into a tp_size 1 decode server's reservation."""
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
        with self._lock:
            ended, self._ended = self._ended, []
        out = []
        for rank, e in [(0, e) for e in self._local.take_finished()] + ended:
            stop, group_end = self._parts.feed(rank, e)
            for r, tid in stop:
                self._abort_part(r, tid)
            if group_end is not None:
                self._tids.pop(group_end.transfer_id, None)
                out.append(group_end)
        return out

    def open_transfers(self) -> int:
        return len(self._parts)

    # -- the ranks' pipes -------------------------------------------------------------
    def _abort_part(self, rank: int, tid: str) -> None:
        if rank == 0:
            self._local.abort(tid)
        else:
            self._send(rank, {"op": "abort", "tid": tid})

    def _send(self, rank: int, message: dict) -> None:
        """A message to a rank; a rank that is gone is the engine's problem (its step fails, /health
        says so and the server exits), so a broken pipe is not raised here a second time."""
        try:
            self._ranks.send_message(rank, message)
        except (BrokenPipeError, OSError):
            pass

    def _ask(self, rank: int, message: dict, timeout_s: float | None = None) -> dict:
        fut: Future = Future()
        with self._lock:
            key = next(self._ids)
            self._waiting[key] = fut
        try:
            self._ranks.send_message(rank, {**message, "id": key})
            return fut.result(timeout_s or self._timeout_s)
        finally:
            with self._lock:
                self._waiting.pop(key, None)

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
