"""KVSender: the prefill side. The engine thread queues work; one transfer
thread owns the backend and moves it.

    engine thread                       transfer thread (owns the backend)
    -------------                       ----------------------------------
    begin(tid, peer, dst_blocks, lease) ─┐
    push_layer(tid, layer, blocks, s, e) ├─queue─▶ plan (cached per chunk),
    finish(tid, first_tokens)           ─┘         convert dtype, post write,
                                                   progress, wait writes, send
    take_finished() ◀── TransferEnded ◀─────────── Done notice, wait for Ack
                      (``notify`` wakes the engine thread)

The prefill server calls ``release(request)`` on its engine for every id that
``take_finished`` reports ended, OK or not: the blocks are no longer read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from transfer.backend import Backend, NoticeIn, PeerLost, TransferError
from transfer.copy import region_bytes
from transfer.integrity import CHECKSUM_MODES, checksum_positions, kv_checksum
from transfer.layout import KVLayout, check_compatible
from transfer.messages import Ack, Cancel, CancelAck, Done, Hello, decode, encode
from transfer.outcome import Outcome
from transfer.plan import CopyPlan, common_heads, make_plan, staging_layout
from transfer.recent import RecentIds
from transfer.thread import TransferThread, cache_as_layout, chunk_hint

ACK_GRACE_S = 1.0  # past its lease, how long a sent Done may wait for the receiver's Ack
REMEMBER_CANCELLED = 4096  # transfer ids the receiver cancelled, kept to refuse a late Begin


@dataclass
class _Out:
    tid: str
    peer: str
    dst_ids: np.ndarray
    deadline: float
    heads: tuple[int, ...] | None = None  # global heads to send (a TP route); None: all both sides hold
    plans: dict = field(default_factory=dict)
    inflight: list = field(default_factory=list)
    src_ids: np.ndarray | None = None
    token_start: int = -1
    token_end: int = 0
    layer_start: dict[int, int] = field(default_factory=dict)  # layer -> its first token pushed
    first_tokens: tuple[int, ...] | None = None
    noticed: bool = False
    failed: str = ""
    outcome: Outcome = Outcome.OK  # why it failed, set with ``failed``

    def fail(self, reason: str, outcome: Outcome) -> None:
        """The first failure wins; the transfer ends once nothing is in flight."""
        if not self.failed:
            self.failed, self.outcome = reason, outcome


@dataclass(frozen=True)
class Connect:
    hello: Hello
    done: Future


@dataclass(frozen=True)
class Begin:
    transfer_id: str
    peer: str
    dst_ids: np.ndarray
    deadline: float  # time.monotonic()
    heads: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Push:
    transfer_id: str
    layer: int
    src_ids: np.ndarray
    start: int
    end: int
    event: object  # a torch.cuda.Event to wait for on CUDA, else None


@dataclass(frozen=True)
class Finish:
    transfer_id: str
    first_tokens: tuple[int, ...]


@dataclass(frozen=True)
class Abort:
    transfer_id: str


@dataclass(frozen=True)
class Forget:
    """Command: a decode server left the cluster; release everything held for it."""

    peer: str


class KVSender(TransferThread):
    """Pushes prefilled KV into decode servers' reserved blocks."""

    role = "prefill"
    wait_on_commands = True

    def __init__(
        self,
        backend: Backend,
        cache: torch.Tensor,
        layout: KVLayout,
        *,
        name: str,
        model: str,
        checksum: str = "sampled",
        notify: Callable[[], None] | None = None,
    ) -> None:
        if checksum not in CHECKSUM_MODES:
            raise ValueError(f"checksum {checksum!r} is not one of {CHECKSUM_MODES}")
        self._cache = cache_as_layout(cache, layout)
        self._layout, self._model = layout, model
        self._checksum = checksum
        self._peers: dict[str, Hello] = {}
        self._staging: dict[str, torch.Tensor] = {}  # dtype -> converted mirror of the cache
        self._out: dict[str, _Out] = {}
        self._cancelled = RecentIds(REMEMBER_CANCELLED)  # transfer thread only
        self._stats = {"writes": 0, "ranges": 0, "bytes": 0, "post_s": 0.0}
        backend.register("kv", self._cache)
        super().__init__(backend, name, notify)

    # -- called from any thread ------------------------------------------
    def connect(self, peer_hello: bytes, timeout_s: float = 30.0) -> str:
        """Meet a decode server (its ``KVReceiver.accept`` answer); returns its
        name. Raises IncompatiblePeer naming both values."""
        hello = msgspec.msgpack.decode(peer_hello, type=Hello)
        check_compatible(self._model, self._layout, hello.model, hello.layout, "prefill", hello.role)
        if hello.backend != self.backend.kind:
            raise ValueError(f"decode uses transfer backend {hello.backend!r}, prefill {self.backend.kind!r}")
        fut: Future = Future()
        self._submit(Connect(hello, fut))
        fut.result(timeout_s)
        return hello.name

    @property
    def layout(self) -> KVLayout:
        """This rank's cache layout (its KV heads, block size, order, dtype)."""
        return self._layout

    def peer_layout(self, peer: str) -> KVLayout:
        """The layout a decode rank met by ``connect`` announced (KeyError if not met)."""
        return self._peers[peer].layout

    def begin(self, transfer_id: str, peer: str, dst_block_ids, lease_s: float, heads=None) -> None:
        """Start a transfer into ``peer``'s reserved ``dst_block_ids``; writes
        stop when ``lease_s`` runs out. ``heads``: the global KV heads this rank
        sends (its part of a TP route, ``transfer.tp.rank_parts``); None sends
        every head both sides hold."""
        heads = None if heads is None else tuple(int(h) for h in heads)
        ids = np.asarray(dst_block_ids, dtype=np.int64)
        self._submit(Begin(transfer_id, peer, ids, time.monotonic() + lease_s, heads))

    def push_layer(self, transfer_id: str, layer: int, src_block_ids, start: int, end: int) -> None:
        """Queue layer ``layer`` of tokens [start, end) (already in the cache)."""
        event = None
        if self._cache.is_cuda:  # the write must not start before the layer's kernels finish
            event = torch.cuda.Event()
            event.record()
        self._submit(Push(transfer_id, layer, np.asarray(src_block_ids, dtype=np.int64), start, end, event))

    def finish(self, transfer_id: str, first_tokens: Sequence[int]) -> None:
        """All layers are pushed: send the Done notice (the first token of each sequence) once they landed."""
        self._submit(Finish(transfer_id, tuple(int(t) for t in first_tokens)))

    def abort(self, transfer_id: str) -> None:
        """Drop a transfer (request aborted): nothing more is written."""
        self._submit(Abort(transfer_id))

    def forget(self, peer: str) -> None:
        """A decode server left: its transfers fail (peer_lost) and the backend releases what it
        held for it (NIXL remote agent and descriptor lists, ZeroMQ socket). A replacement at the
        same name is met afresh by ``connect``."""
        self._submit(Forget(peer))

    def open_transfers(self) -> int:
        """Transfers begun and not ended (read from any thread: a size, for GET /debug/bookkeeping)."""
        return len(self._out)

    def remembered_cancels(self) -> int:
        """Cancelled transfer ids remembered (at most ``REMEMBER_CANCELLED``)."""
        return len(self._cancelled)

    def stats(self) -> dict:
        """Layer writes posted, their ranges and bytes, and the transfer
        thread's seconds spent planning, converting and posting them."""
        return dict(self._stats)

    # -- transfer thread -------------------------------------------------
    def _handle_all(self, cmds: list) -> None:
        """An abort also drops the pushes queued before it and not posted yet:
        its request is gone, so nothing more of it is read or sent."""
        aborted = {cmd.transfer_id for cmd in cmds if isinstance(cmd, Abort)}
        for cmd in cmds:
            if not (isinstance(cmd, Push) and cmd.transfer_id in aborted):
                self._handle(cmd)

    def _handle(self, cmd) -> None:
        match cmd:
            case Connect(hello, done):
                self._connect(hello, done)
            case Begin(tid, peer, dst_ids, deadline, heads):
                if tid in self._cancelled:
                    self._ended(tid, Outcome.CANCELLED, "cancelled by the receiver before it started")
                elif peer not in self._peers:
                    self._ended(tid, Outcome.TRANSPORT, f"not connected to {peer!r}")
                else:
                    self._out[tid] = _Out(tid, peer, dst_ids, deadline, heads)
            case Push():
                self._push(cmd)
            case Finish(tid, first_tokens):
                out = self._out.get(tid)
                if out is not None:
                    out.first_tokens = first_tokens
            case Abort(tid):
                out = self._out.get(tid)
                if out is not None:
                    out.fail("aborted", Outcome.ABORTED)
            case Forget(peer):
                for out in self._out.values():
                    if out.peer == peer:
                        out.fail(f"decode peer {peer!r} left the cluster", Outcome.PEER_LOST)
                if self._peers.pop(peer, None) is not None:
                    self.backend.disconnect(peer)

    def _connect(self, hello: Hello, fut: Future) -> None:
        try:
            self.backend.connect(hello.name, hello.backend_meta)
            region = "kv"
            if hello.layout.dtype != self._layout.dtype:
                region = f"staging:{hello.layout.dtype}"
                if hello.layout.dtype not in self._staging:
                    mirror = torch.empty_like(self._cache, dtype=getattr(torch, hello.layout.dtype))
                    self._staging[hello.layout.dtype] = mirror
                    self.backend.register(region, mirror)
            src = staging_layout(self._layout, hello.layout.dtype)
            self.backend.prepare(hello.name, region, chunk_hint(src, hello.layout))
            self._peers[hello.name] = hello
            fut.set_result(hello.name)
        except Exception as exc:
            fut.set_exception(exc)

    def _push(self, push: Push) -> None:
        tid, layer, src_ids, start, end = push.transfer_id, push.layer, push.src_ids, push.start, push.end
        out = self._out.get(tid)
        if out is None or out.failed or start >= end:
            return
        t0 = time.perf_counter()
        dst = self._peers[out.peer].layout
        key = (start, end, src_ids.tobytes())
        plan: CopyPlan | None = out.plans.get(key)
        try:
            if plan is None:
                src = staging_layout(self._layout, dst.dtype)
                plan = make_plan(src, src_ids, start, end, dst, out.dst_ids, out.heads)
                out.plans[key] = plan
            if push.event is not None:
                push.event.synchronize()
            region = "kv"
            if dst.dtype != self._layout.dtype:
                region = f"staging:{dst.dtype}"
                used = src_ids[start // self._layout.block_size : (end - 1) // self._layout.block_size + 1]
                self._convert(dst.dtype, layer, torch.from_numpy(used))
            if plan.num_ranges:
                out.inflight.append(self.backend.write(out.peer, tid, layer, region, *plan.layer(layer)))
        except (TransferError, ValueError) as exc:
            out.fail(str(exc), Outcome.TRANSPORT)
            return
        self._stats["writes"] += 1
        self._stats["ranges"] += plan.num_ranges
        self._stats["bytes"] += plan.layer_nbytes
        self._stats["post_s"] += time.perf_counter() - t0
        out.src_ids = src_ids if out.src_ids is None or len(src_ids) >= len(out.src_ids) else out.src_ids
        out.token_start = start if out.token_start < 0 else min(out.token_start, start)
        out.token_end = max(out.token_end, end)
        out.layer_start[layer] = min(out.layer_start.get(layer, start), start)

    def _convert(self, dtype: str, layer: int, blocks: torch.Tensor) -> None:
        src, dst = self._cache[layer], self._staging[dtype][layer]
        dim = 0 if self._layout.kv_fused else 1  # the block axis inside a layer
        dst.index_copy_(dim, blocks.to(src.device), src.index_select(dim, blocks.to(src.device)).to(dst.dtype))

    def _progress(self, now: float) -> bool:
        busy = False
        for out in list(self._out.values()):
            try:
                out.inflight = [h for h in out.inflight if not self.backend.write_done(h)]
            except TransferError as exc:
                out.fail(str(exc), Outcome.TRANSPORT)
                out.inflight = []
            if not out.failed and now > out.deadline + (ACK_GRACE_S if out.noticed else 0.0):
                if out.noticed:
                    out.fail("no answer to the Done notice", Outcome.NO_ACK)
                else:
                    out.fail("lease expired before the transfer finished", Outcome.LEASE_EXPIRED)
            if out.failed and not out.inflight:
                self._end(out, out.outcome, out.failed)
                continue
            if out.first_tokens is not None and not out.inflight and not out.noticed:
                self._send_done(out)
            busy = busy or bool(out.inflight) or out.noticed
        return busy

    def _tracking(self) -> bool:
        return bool(self._out)

    def _send_done(self, out: _Out) -> None:
        dst = self._peers[out.peer].layout
        start = max(out.token_start, 0)
        pos = checksum_positions(out.tid, dst.block_size, start, out.token_end, self._checksum)
        src = staging_layout(self._layout, dst.dtype)
        heads = common_heads(src, dst) if out.heads is None else out.heads
        region = region_bytes(self._staging.get(dst.dtype, self._cache))
        # A layer pushed from a later token (a sliding window's) or not at all is named with where it starts.
        layer_starts = tuple(max(out.layer_start.get(i, out.token_end), start) for i in range(src.num_layers))
        if all(s == start for s in layer_starts):
            layer_starts = ()
        src_ids = out.src_ids if out.src_ids is not None else []
        checksum = kv_checksum(region, src, src_ids, pos, heads, layer_starts)
        done = Done(
            out.tid, self.name, out.first_tokens, start, out.token_end, heads, checksum, self._checksum, layer_starts
        )
        try:
            self.backend.send_notice(out.peer, encode(done))
            out.noticed = True
        except TransferError as exc:
            out.fail(str(exc), Outcome.TRANSPORT)

    def _on_incoming(self, item) -> None:
        if isinstance(item, PeerLost):
            for out in self._out.values():
                if out.peer == item.peer:
                    out.fail(f"decode peer {item.peer!r} is gone", Outcome.PEER_LOST)
            return
        if not isinstance(item, NoticeIn):
            return
        try:
            msg = decode(item.payload)
        except msgspec.DecodeError:
            return
        if isinstance(msg, Ack):
            out = self._out.get(msg.transfer_id)
            if out is not None and out.noticed:
                if msg.ok:
                    self._end(out, Outcome.OK)
                else:
                    self._end(out, Outcome.REFUSED, msg.reason or "refused by the receiver")
        elif isinstance(msg, Cancel):
            self._cancelled.add(msg.transfer_id)
            out = self._out.get(msg.transfer_id)
            if out is not None:  # answered by _end, once nothing of it is in flight
                out.fail("cancelled by the receiver", Outcome.CANCELLED)
            else:
                self._send_quietly(item.peer, CancelAck(msg.transfer_id, self.name))

    def _end(self, out: _Out, outcome: Outcome, reason: str = "") -> None:
        del self._out[out.tid]
        if out.tid in self._cancelled:
            self._send_quietly(out.peer, CancelAck(out.tid, self.name))
        self._ended(out.tid, outcome, reason)

    def _send_quietly(self, peer: str, msg) -> None:
        try:
            self.backend.send_notice(peer, encode(msg))
        except TransferError:
            pass  # that peer is gone; it cannot be waiting for us
