"""What the sender and the receiver share: the transfer thread that owns the
backend, the events it reports, and small layout helpers."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from transfer.backend import Backend
from transfer.layout import KVLayout, dtype_name
from transfer.messages import Hello, encode

log = logging.getLogger(__name__)
_STOP = ("stop",)


@dataclass(frozen=True)
class Completed:
    transfer_id: str
    first_token: int | None = None  # receiver side: the token prefill sampled


@dataclass(frozen=True)
class Failed:
    """``code`` says why, for the server to act on (``reason`` is for people):
    receiver: lease_expired, cancelled, checksum_mismatch, bad_notice,
    out_of_bounds; sender: aborted, cancelled (the receiver cancelled it),
    refused (the receiver refused the KV), peer_lost, lease_expired, no_ack,
    transport."""

    transfer_id: str
    reason: str
    code: str = "failed"


@dataclass
class Events:
    """What ``poll()`` returns: transfers that ended since the last call."""

    completed: list[Completed] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)


class TransferEvents:
    """Thread-safe inbox of ended transfers (transfer thread -> caller)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events = Events()

    def complete(self, tid: str, first_token: int | None = None) -> None:
        with self._lock:
            self._events.completed.append(Completed(tid, first_token))

    def fail(self, tid: str, reason: str, code: str = "failed") -> None:
        with self._lock:
            self._events.failed.append(Failed(tid, reason, code))

    def drain(self) -> Events:
        with self._lock:
            out, self._events = self._events, Events()
        return out


def cache_as_layout(cache: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The cache viewed in the layout's shape, after checking it fits."""
    if not cache.is_contiguous():
        raise ValueError("the KV cache must be one contiguous tensor")
    if dtype_name(cache.dtype) != layout.dtype:
        raise ValueError(f"cache dtype {cache.dtype} does not match layout dtype {layout.dtype}")
    if cache.numel() * cache.element_size() != layout.total_bytes:
        raise ValueError(f"cache of shape {tuple(cache.shape)} does not match layout {layout.shape}")
    return cache.view(layout.shape)


def chunk_hint(src: KVLayout, dst: KVLayout) -> int:
    """Bytes of the largest piece every whole-block run between the two
    layouts is made of (0: ranges are too irregular to prepare for)."""
    if src.head_ids != dst.head_ids or src.order != dst.order or src.dtype != dst.dtype:
        return 0
    if src.order == "HND" and src.block_size != dst.block_size:
        return 0
    return math.gcd(src.block_size, dst.block_size) * src.num_heads * src.vec_bytes


class TransferThread:
    """Owns a backend on one thread: commands in through a queue, ended
    transfers out through ``poll``. Subclasses implement ``_handle`` (a
    command), ``_progress`` (returns True while work is in flight) and
    ``_on_incoming`` (one item from ``backend.poll``)."""

    role = ""
    busy_wait_s = 0.0002
    idle_wait_s = 0.002
    # Where the thread sleeps between rounds: on its command queue (a sender:
    # the engine's pushes wake it at once) or in the backend (a receiver: the
    # ZeroMQ poller wakes it when data arrives; NIXL can only sleep).
    wait_on_commands = False

    def __init__(self, backend: Backend, name: str) -> None:
        self.backend = backend
        self.name = name
        self._events = TransferEvents()
        self._cmds: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._closed = False
        self.contained_errors = 0  # incoming items that raised: dropped (transfer thread writes, others read)
        self.last_round = time.monotonic()  # when the thread last went round its loop (see ``problem``)
        self._hello = encode(Hello(self.role, name, self._model, self._layout, backend.kind,
                                   backend.metadata()))
        self._thread = threading.Thread(target=self._run, name=f"kv-{self.role}-{name}", daemon=True)
        self._thread.start()

    def hello(self) -> bytes:
        """This side's handshake message (carry it over the control plane)."""
        return self._hello

    def poll(self) -> Events:
        """Transfers that completed or failed since the last call."""
        if self._error is not None:
            raise RuntimeError(f"{self.role} transfer thread died: {self._error!r}") from self._error
        return self._events.drain()

    def problem(self, stuck_after_s: float) -> str | None:
        """Why this side cannot work (its thread died, or went no round for
        ``stuck_after_s`` while it loops every few milliseconds), or None."""
        if self._error is not None or (self._thread.ident is not None and not self._thread.is_alive()
                                       and not self._closed):
            return f"{self.role} transfer thread died: {self._error!r}"
        stalled = time.monotonic() - self.last_round
        if stalled > stuck_after_s:
            return f"{self.role} transfer thread made no progress for {stalled:.0f} s"
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and release the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._cmds.put(_STOP)
        self._thread.join(timeout_s)

    def _submit(self, cmd: tuple) -> None:
        if self._closed:
            raise RuntimeError(f"{self.role} transfer side {self.name!r} is closed")
        if self._error is not None:
            raise RuntimeError(f"{self.role} transfer thread died: {self._error!r}")
        self._cmds.put(cmd)

    def _run(self) -> None:
        try:
            busy = False
            while True:
                wait = self.busy_wait_s if busy else self.idle_wait_s
                cmds = self._drain(wait if self.wait_on_commands else 0.0)
                if _STOP in cmds:
                    return
                self._handle_all(cmds)
                timeout = 0.0 if cmds or self.wait_on_commands else wait
                for item in self.backend.poll(timeout):
                    self._take(item)
                busy = self._progress(time.monotonic())
                self.last_round = time.monotonic()
        except BaseException as exc:  # reported by poll(); the thread must not die silently
            log.exception("%s transfer thread %s died", self.role, self.name)
            self._error = exc
        finally:
            try:
                self.backend.close()
            except Exception:
                log.exception("closing the %s backend", self.backend.kind)

    def _take(self, item) -> None:
        """One incoming item; one that raises is dropped and counted, never fatal to the thread."""
        try:
            self._on_incoming(item)
        except Exception:
            self.contained_errors += 1
            log.exception("%s transfer thread %s dropped an incoming %s", self.role, self.name,
                          type(item).__name__)

    def _drain(self, timeout_s: float) -> list:
        """Queued commands; waits up to ``timeout_s`` for the first one."""
        cmds = []
        try:
            cmds.append(self._cmds.get(timeout=timeout_s) if timeout_s > 0 else self._cmds.get_nowait())
            while True:
                cmds.append(self._cmds.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _handle_all(self, cmds: list) -> None:
        for cmd in cmds:
            self._handle(cmd)

    def _handle(self, cmd: tuple) -> None:
        raise NotImplementedError

    def _progress(self, now: float) -> bool:
        raise NotImplementedError

    def _on_incoming(self, item) -> None:
        raise NotImplementedError
