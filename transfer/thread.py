"""What the sender and the receiver share: the transfer thread that owns the
backend, the events it reports, and small layout helpers."""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from transfer.backend import Backend
from transfer.layout import KVLayout, dtype_name
from transfer.messages import Hello, encode
from transfer.outcome import Outcome, TransferEnded

log = logging.getLogger(__name__)


class Finished:
    """Thread-safe inbox of ended transfers: the transfer thread puts, the
    owner takes them between its own steps. ``notify`` (if given) is called
    after each put, so an owner that sleeps while idle wakes at once."""

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._ended: list[TransferEnded] = []
        self._notify = notify

    def put(self, ended: TransferEnded) -> None:
        with self._lock:
            self._ended.append(ended)
        self.wake()

    def wake(self) -> None:
        if self._notify is not None:
            self._notify()

    def take(self) -> list[TransferEnded]:
        with self._lock:
            out, self._ended = self._ended, []
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


@dataclass(frozen=True)
class Stop:
    """Command: end the transfer thread."""


@dataclass(frozen=True)
class Wake:
    """Command: none, only ends a resting thread's wait (a transfer was opened)."""


class TransferThread:
    """Owns a backend on one thread: commands in through a queue (small frozen
    dataclasses, handled with ``match``), ended transfers out through
    ``take_finished``. Built complete, started by ``start()``. Subclasses
    implement ``_handle`` (one command), ``_progress`` (returns True while
    bytes are in flight), ``_tracking`` (True while any transfer is open) and
    ``_on_incoming`` (one item from ``backend.poll``).

    ``notify`` is called on the transfer thread whenever a transfer ended:
    the owner (the server's engine thread) wakes and takes the finished ones
    between two steps, so a result crosses one thread boundary."""

    role = ""
    busy_wait_s = 0.0002  # bytes in flight: look again soon
    idle_wait_s = 0.002  # transfers open, nothing in flight: leases still need checking
    rest_wait_s = 0.1  # no transfer at all: an idle server costs next to no CPU
    # Where the thread sleeps between rounds: on its command queue (a sender:
    # the engine's pushes wake it at once) or in the backend (a receiver: the
    # ZeroMQ poller wakes it when data arrives; NIXL can only sleep).
    wait_on_commands = False

    def __init__(self, backend: Backend, name: str, notify: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.name = name
        self._finished = Finished(notify)
        self._cmds: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._closed = False
        self.contained_errors = 0  # incoming items that raised: dropped (transfer thread writes, others read)
        self.last_round = time.monotonic()  # when the thread last went round its loop (see ``problem``)
        self.instance = secrets.token_hex(16)
        self._hello = encode(
            Hello(self.role, name, self._model, self._layout, backend.kind, backend.metadata(), self.instance)
        )
        self._thread = threading.Thread(target=self._run, name=f"kv-{self.role}-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def hello(self) -> bytes:
        """This side's handshake message (carry it over the control plane)."""
        return self._hello

    @property
    def alive(self) -> bool:
        """The thread runs (or was not started yet) and has not died."""
        return self._error is None and (self._thread.ident is None or self._thread.is_alive())

    def take_finished(self) -> list[TransferEnded]:
        """Transfers that ended since the last call. Raises RuntimeError once
        the transfer thread died: nothing will end any more."""
        if self._error is not None:
            raise RuntimeError(f"{self.role} transfer thread died: {self._error!r}") from self._error
        return self._finished.take()

    def problem(self, stuck_after_s: float) -> str | None:
        """Why this side cannot work (its thread died, or went no round for
        ``stuck_after_s`` while it loops every few milliseconds), or None."""
        if self._error is not None or (
            self._thread.ident is not None and not self._thread.is_alive() and not self._closed
        ):
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
        if self._thread.ident is None:
            self.backend.close()
            return
        self._cmds.put(Stop())
        self._thread.join(timeout_s)

    def _submit(self, cmd) -> None:
        if self._closed:
            raise RuntimeError(f"{self.role} transfer side {self.name!r} is closed")
        if self._error is not None:
            raise RuntimeError(f"{self.role} transfer thread died: {self._error!r}")
        self._cmds.put(cmd)

    def _ended(
        self, transfer_id: str, outcome: Outcome, reason: str = "", first_tokens: tuple[int, ...] | None = None
    ) -> None:
        self._finished.put(TransferEnded(transfer_id, outcome, reason, first_tokens))

    def _run(self) -> None:
        try:
            busy, tracking = False, False
            while True:
                wait = self.busy_wait_s if busy else self.idle_wait_s if tracking else self.rest_wait_s
                # Resting (no transfer open), every side sleeps on its commands: opening a transfer wakes it.
                on_commands = self.wait_on_commands or not (busy or tracking)
                cmds = self._drain(wait if on_commands else 0.0)
                if any(isinstance(cmd, Stop) for cmd in cmds):
                    return
                self._handle_all([cmd for cmd in cmds if not isinstance(cmd, Wake)])
                timeout = 0.0 if cmds or on_commands else wait
                for item in self.backend.poll(timeout):
                    self._take(item)
                busy = self._progress(time.monotonic())
                tracking = self._tracking()
                self.last_round = time.monotonic()
        except BaseException as exc:  # reported by take_finished(); the thread must not die silently
            log.exception("%s transfer thread %s died", self.role, self.name)
            self._error = exc
            self._finished.wake()  # the owner learns it at once from take_finished()
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
            log.exception("%s transfer thread %s dropped an incoming %s", self.role, self.name, type(item).__name__)

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

    def _handle(self, cmd) -> None:
        raise NotImplementedError

    def _progress(self, now: float) -> bool:
        raise NotImplementedError

    def _tracking(self) -> bool:
        """Any transfer open (leases to check, notices to expect)?"""
        raise NotImplementedError

    def _on_incoming(self, item) -> None:
        raise NotImplementedError
