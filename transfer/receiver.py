"""KVReceiver: the decode side. It issues transfer ids for reserved blocks,
checks what arrives, and reports transfers that ended.

    decode server                        transfer thread (owns the backend)
    -------------                        ----------------------------------
    tid = expect(block_ids, lease_s) ──▶ issued ids (id, blocks, deadline)
                                         WriteIn: known id and reserved blocks?
                                                  apply : drop and count
                                         Done: checksum over our blocks? Ack
    take_finished() ◀── TransferEnded(tid, OK, first_tokens) / (tid, outcome, reason)
    (the thread calls ``notify`` after each, so the owner wakes and takes them)

Contract for the server: free a reservation's blocks only after
``take_finished`` reported its id (completed, failed or cancelled). With NIXL the prefill side
writes one-sided, so an expired or cancelled id is first announced to every
connected sender (Cancel) and reported failed once they all answered that
nothing of it is in flight (CancelAck), or after ``cancel_grace_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from transfer.backend import Backend, Dropped, NoticeIn, PeerLost, TransferError, WriteIn
from transfer.copy import region_bytes
from transfer.integrity import CHECKSUM_MODES, Expected, IssuedTransfers, checksum_positions, kv_checksum
from transfer.layout import KVLayout, check_compatible
from transfer.messages import MAX_SEQUENCES, Ack, Cancel, CancelAck, Done, Hello, decode, encode
from transfer.outcome import Outcome, PeerBound
from transfer.plan import ranges_inside
from transfer.thread import TransferThread, Wake, cache_as_layout


@dataclass(frozen=True)
class Accept:
    """Command: connect back to a prefill server that sent its hello."""

    hello: Hello
    done: Future


@dataclass(frozen=True)
class CancelTransfer:
    """Command: stop waiting for a transfer."""

    transfer_id: str
    reason: str


class KVReceiver(TransferThread):
    """Accepts prefilled KV into blocks this decode server reserved."""

    role = "decode"
    busy_wait_s = 0.0005  # one-sided (NIXL): how often notices are looked for while KV is expected

    def __init__(
        self,
        backend: Backend,
        cache: torch.Tensor,
        layout: KVLayout,
        *,
        name: str,
        model: str,
        cancel_grace_s: float = 1.0,
        notify: Callable[[], None] | None = None,
    ) -> None:
        if not backend.one_sided:
            # Writes and notices arrive through the backend's poll, which wakes the
            # thread at once: a short timeout would only spin (and take the GIL from
            # the engine thread) while a transfer is expected.
            self.busy_wait_s = self.idle_wait_s
        self._layout, self._model = layout, model
        self._cache = cache_as_layout(cache, layout)
        self._region = region_bytes(self._cache)
        self._grace = cancel_grace_s
        self._lock = threading.Lock()  # the issued ids: expect() runs on the server's thread
        self._issued = IssuedTransfers(name)
        self._senders: dict[str, str] = {}  # prefill servers met: name -> the instance bound to it
        self._cancel_acks: dict[str, set[str]] = {}
        backend.register("kv", self._cache)
        backend.set_write_limit(self._write_limit)
        super().__init__(backend, name, notify)

    # -- called from the server's threads ---------------------------------
    def accept(self, sender_hello: bytes, timeout_s: float = 30.0) -> bytes:
        """First meeting with a prefill server: check compatibility (raises
        IncompatiblePeer naming both values), connect back for notices, and
        return our hello for it to ``connect`` with.

        A name stays bound to the instance that met it: a hello from another
        instance under that name (a restarted server, or anyone holding the
        internal secret) replaces it only once the bound one's connection is gone
        (``Backend.peer_connected``); while it lives, PeerBound is raised and the
        live binding is untouched."""
        hello = msgspec.msgpack.decode(sender_hello, type=Hello)
        check_compatible(self._model, self._layout, hello.model, hello.layout, "decode", hello.role)
        if hello.backend != self.backend.kind:
            raise ValueError(f"prefill uses transfer backend {hello.backend!r}, decode {self.backend.kind!r}")
        done: Future = Future()
        self._submit(Accept(hello, done))
        try:
            done.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"accepting {hello.name!r} took over {timeout_s} s") from None
        # Ours, with what the backend bound to this sender alone (its ZeroMQ identity).
        return encode(
            Hello(
                self.role,
                self.name,
                self._model,
                self._layout,
                self.backend.kind,
                self.backend.metadata_for(hello.name),
            )
        )

    @property
    def layout(self) -> KVLayout:
        """This rank's cache layout (its KV heads, block size, order, dtype)."""
        return self._layout

    def expect(self, block_ids, lease_s: float, writable_from: int = 0) -> str:
        """Issue a transfer id for ``block_ids`` (reserved by the engine),
        valid for ``lease_s`` seconds. It completes once verified Done notices
        cover every KV head this rank holds, each head from exactly one sender:
        one prefill rank, or several (TP, ``transfer.tp``) each sending its
        heads. Writes may touch only ``block_ids[writable_from:]``: the blocks
        before are a cached prefix that other requests may be reading."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self._layout.num_blocks):
            raise ValueError(f"block ids outside [0, {self._layout.num_blocks}): {ids.tolist()}")
        if not 0 <= writable_from < max(len(ids), 1):
            raise ValueError(f"writable_from {writable_from} is outside the {len(ids)} reserved blocks")
        with self._lock:
            tid = self._issued.issue(ids, lease_s, writable_from=writable_from)
        self._cmds.put(Wake())  # a resting thread now looks for this transfer's notices
        return tid

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Stop waiting (client gone, request aborted); ``take_finished``
        reports it (``Outcome.CANCELLED``) once no write can still land."""
        self._submit(CancelTransfer(transfer_id, reason))

    def open_transfers(self) -> int:
        """Transfer ids issued and not ended (GET /debug/bookkeeping)."""
        with self._lock:
            return len(self._issued)

    def counters(self) -> dict[str, int]:
        with self._lock:
            counters = dict(self._issued.counters)
        counters["contained_errors"] = self.contained_errors
        return counters

    def _write_limit(self, transfer_id: str) -> int | None:
        """The most bytes one write of ``transfer_id`` may carry: one layer's K and V of its blocks."""
        with self._lock:
            entry = self._issued.live(transfer_id)
        return None if entry is None else 2 * len(entry.block_ids) * self._layout.block_bytes

    # -- transfer thread -------------------------------------------------
    def _handle(self, cmd) -> None:
        match cmd:
            case Accept(hello, done):
                try:
                    bound = self._senders.get(hello.name)
                    if bound is not None and bound != hello.instance and self.backend.peer_connected(hello.name):
                        self._bump("hello_refused_bound")
                        raise PeerBound(f"{hello.name!r} is bound to another instance that is still connected")
                    self.backend.connect(hello.name, hello.backend_meta)
                    self._senders[hello.name] = hello.instance
                    done.set_result(None)
                except Exception as exc:
                    done.set_exception(exc)
            case CancelTransfer(transfer_id, reason):
                with self._lock:
                    entry = self._issued.live(transfer_id)
                if entry is not None and not entry.cancelling:
                    self._start_cancel(entry, reason, time.monotonic(), Outcome.CANCELLED)

    def _progress(self, now: float) -> bool:
        with self._lock:
            overdue = self._issued.overdue(now)
            cancelling = self._issued.being_cancelled()
            active = bool(self._issued.active())
        for entry in overdue:
            self._start_cancel(entry, "lease expired before the KV arrived", now, Outcome.LEASE_EXPIRED)
        for entry in cancelling:
            acks = self._cancel_acks.get(entry.transfer_id, set())
            if self._senders.keys() <= acks or now >= entry.cancel_deadline:
                self._end(entry, entry.cancel_code, entry.cancel_reason or "")
        return active

    def _tracking(self) -> bool:
        with self._lock:
            return bool(self._issued.active())

    def _start_cancel(self, entry: Expected, reason: str, now: float, outcome: Outcome) -> None:
        entry.cancel_reason, entry.cancel_code, entry.cancel_deadline = reason, outcome, now + self._grace
        self._cancel_acks[entry.transfer_id] = set()
        for peer in list(self._senders):
            self._send_quietly(peer, Cancel(entry.transfer_id))
        if not self.backend.one_sided:
            self._end(entry, outcome, reason)  # we apply writes ourselves: none can land now

    def _end(
        self, entry: Expected, outcome: Outcome, reason: str = "", first_tokens: tuple[int, ...] | None = None
    ) -> None:
        with self._lock:
            self._issued.end(entry.transfer_id, outcome is Outcome.OK)
        self._cancel_acks.pop(entry.transfer_id, None)
        self._ended(entry.transfer_id, outcome, reason, first_tokens)

    def _on_incoming(self, item) -> None:
        if isinstance(item, WriteIn):
            self._on_write(item)
        elif isinstance(item, PeerLost):
            self._senders.pop(item.peer, None)
        elif isinstance(item, Dropped):
            if item.reason == "unknown_transfer":
                with self._lock:
                    self._issued.count_drop(item.transfer_id)
            else:
                self._bump(f"dropped_{item.reason}")
        elif isinstance(item, NoticeIn):
            try:
                msg = decode(item.payload)
            except msgspec.DecodeError:
                return
            if isinstance(msg, Done):
                self._on_done(item.peer, msg)
            elif isinstance(msg, CancelAck):
                if msg.transfer_id in self._cancel_acks:
                    self._cancel_acks[msg.transfer_id].add(item.peer)

    def _on_write(self, write: WriteIn) -> None:
        with self._lock:
            entry = self._issued.live(write.transfer_id)
            if entry is None:
                self._issued.count_drop(write.transfer_id)
        if entry is None or entry.cancelling:
            return
        if write.lengths.sum() != len(write.data) or len(write.dst_offsets) != len(write.lengths):
            self._bump("dropped_malformed")
            return
        if not ranges_inside(self._layout, entry.block_ids[entry.writable_from :], write.dst_offsets, write.lengths):
            self._bump("dropped_out_of_bounds")
            self._end(entry, Outcome.OUT_OF_BOUNDS, f"{write.peer!r} wrote outside the reserved blocks")
            return
        self.backend.apply(write)

    def _on_done(self, peer: str, done: Done) -> None:
        with self._lock:
            entry = self._issued.live(done.transfer_id)
            if entry is None:
                self._issued.count_drop(done.transfer_id)
        if entry is None or entry.cancelling:
            self._send_quietly(peer, Ack(done.transfer_id, False, "unknown or expired transfer id"))
            return
        outcome, reason = self._verify(entry, done, peer)
        self._send_quietly(peer, Ack(done.transfer_id, outcome is Outcome.OK, reason))
        if outcome is not Outcome.OK:
            if outcome is Outcome.CHECKSUM_MISMATCH:
                self._bump("checksum_failures")
            self._end(entry, outcome, reason)
            return
        entry.done[peer] = done  # by the connection it came on, not the name the notice claims
        if entry.heads_arrived() == set(self._layout.head_ids):
            self._end(entry, Outcome.OK, "", done.first_tokens)

    def _verify(self, entry: Expected, done: Done, peer: str) -> tuple[Outcome, str]:
        """(outcome, reason)."""
        capacity = len(entry.block_ids) * self._layout.block_size
        if done.checksum_mode not in CHECKSUM_MODES:
            return Outcome.BAD_NOTICE, f"bad checksum mode {done.checksum_mode!r}"
        if not 1 <= len(done.first_tokens) <= MAX_SEQUENCES or not all(0 <= t < 1 << 31 for t in done.first_tokens):
            return Outcome.BAD_NOTICE, f"bad first tokens {done.first_tokens[: MAX_SEQUENCES + 1]}"
        if not 0 <= done.token_start <= done.token_end <= capacity:
            return Outcome.BAD_NOTICE, f"tokens [{done.token_start}, {done.token_end}) do not fit {capacity} slots"
        starts = done.layer_starts
        if starts and (
            len(starts) != self._layout.num_layers or not all(done.token_start <= s <= done.token_end for s in starts)
        ):
            return Outcome.BAD_NOTICE, f"layer starts {starts[: self._layout.num_layers + 1]} do not fit the layers"
        if not set(done.heads) <= set(self._layout.head_ids) or len(set(done.heads)) != len(done.heads):
            return Outcome.BAD_NOTICE, f"heads {done.heads} are not distinct heads held here"
        if peer in entry.done:
            return Outcome.BAD_NOTICE, f"{peer!r} already sent its Done notice"
        overlap = set(done.heads) & entry.heads_arrived()
        if overlap:
            return Outcome.BAD_NOTICE, f"heads {sorted(overlap)} already arrived from another sender"
        first = next(iter(entry.done.values()), None)
        if first is not None and first.first_tokens != done.first_tokens:
            return Outcome.BAD_NOTICE, f"first tokens {done.first_tokens} differ from {first.first_tokens}"
        pos = checksum_positions(
            done.transfer_id, self._layout.block_size, done.token_start, done.token_end, done.checksum_mode
        )
        got = kv_checksum(self._region, self._layout, entry.block_ids, pos, done.heads, starts)
        if got != done.checksum:
            return Outcome.CHECKSUM_MISMATCH, f"checksum mismatch (sent {done.checksum:#x}, received {got:#x})"
        return Outcome.OK, ""

    def _bump(self, counter: str) -> None:
        with self._lock:
            counters = self._issued.counters
            counters[counter] = counters.get(counter, 0) + 1

    def _send_quietly(self, peer: str, msg) -> None:
        try:
            self.backend.send_notice(peer, encode(msg))
        except TransferError:
            pass  # a sender that is gone cannot be waiting for this
