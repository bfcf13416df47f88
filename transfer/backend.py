"""The one small interface every byte mover implements.

A backend is owned by exactly one thread (the sender's or receiver's transfer
thread): NIXL agents are not safe to share between threads, so nothing here
locks. Regions are registered once; peers are connected from the metadata
bytes they publish (msgpack, never pickle).

Two kinds of backend:

* one-sided (NIXL): ``write`` puts bytes straight into the peer's registered
  region; the receiver only ever sees notices (``poll`` returns NoticeIn).
* message (ZeroMQ, in-process): ``write`` sends a header and one packed frame;
  the receiver's ``poll`` returns WriteIn and the receiver decides, by
  transfer id and reserved blocks, whether to ``apply`` it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np


class TransferError(RuntimeError):
    """A write or notice failed (peer gone, transport error)."""


@dataclass
class NoticeIn:
    peer: str
    payload: bytes


@dataclass
class WriteIn:
    """A message-backend write, not yet applied. ``data`` is only valid until
    the next ``poll`` (it may live in a reused staging buffer)."""

    peer: str
    transfer_id: str
    layer: int
    dst_offsets: np.ndarray
    lengths: np.ndarray
    data: Any


@dataclass
class Dropped:
    """A message-backend frame refused before any of it was applied (and, for a
    write, before its payload was allocated). ``reason``: malformed (bad header
    or frames), oversized (more bytes than the transfer's reservation holds),
    unbound_identity (a connection the authenticated handshake did not bind),
    unknown_transfer (no live reservation for ``transfer_id``)."""

    peer: str
    reason: str
    transfer_id: str = ""


@dataclass
class PeerLost:
    """The transport saw a peer go away (message backends only)."""

    peer: str


class Backend(abc.ABC):
    kind: str = ""
    one_sided: bool = False

    @abc.abstractmethod
    def register(self, region: str, tensor) -> None:
        """Register a contiguous tensor under a name ("kv", "staging:bfloat16")."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to connect to us (includes registered regions)."""

    def metadata_for(self, peer: str) -> bytes:
        """What ``peer`` (connected with ``connect``) needs to connect to us:
        ``metadata`` plus anything bound to that peer alone (ZeroMQ: the
        connection identity the receiver assigned it)."""
        return self.metadata()

    def set_write_limit(self, limit) -> None:  # noqa: B027 - optional hook: backends without message writes ignore it
        """Receivers of message backends: ``limit(transfer_id)`` is the most
        bytes one write of that transfer may carry (None: no live reservation),
        checked against a write's header before its payload is read."""

    @abc.abstractmethod
    def connect(self, peer: str, metadata: bytes) -> None:
        """(Re)connect to a peer from its metadata; a restarted peer with the
        same name is connected afresh."""

    def peer_connected(self, peer: str) -> bool:
        """Receivers: whether the sender bound to ``peer`` by an earlier ``connect`` still
        holds a live connection. A backend that cannot tell says False (the newest
        handshake for a name then wins)."""
        return False

    def prepare(self, peer: str, region: str, chunk_bytes: int) -> None:  # noqa: B027 - optional hint, a no-op by default
        """Hint: writes from ``region`` to ``peer`` are mostly whole chunks of
        ``chunk_bytes`` at multiples of it on both sides (NIXL prepares
        descriptor lists; others ignore it)."""

    @abc.abstractmethod
    def write(
        self,
        peer: str,
        transfer_id: str,
        layer: int,
        region: str,
        src_offsets: np.ndarray,
        dst_offsets: np.ndarray,
        lengths: np.ndarray,
    ) -> Any:
        """Start writing ranges of a local region into the peer's "kv" region;
        returns a handle for ``write_done``. Raises TransferError."""

    @abc.abstractmethod
    def write_done(self, handle: Any) -> bool:
        """True once the write has landed (and the handle is released);
        raises TransferError when it failed."""

    @abc.abstractmethod
    def send_notice(self, peer: str, payload: bytes) -> None:
        """Send a small message, ordered after this side's completed writes."""

    @abc.abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[NoticeIn | WriteIn | PeerLost | Dropped]:
        """What arrived; may wait up to ``timeout_s`` when the transport can."""

    def apply(self, write: WriteIn) -> None:
        """Scatter an accepted WriteIn into the local "kv" region."""
        raise NotImplementedError(f"{self.kind} backend writes one-sided")

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget a peer (its agent, sockets, prepared lists)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; the backend is unusable afterwards."""
