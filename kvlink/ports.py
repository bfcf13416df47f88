"""The KV link the servers are written against: what they call, and nothing else.

``transfer/`` (KV layouts, copy plans, NIXL/ZeroMQ backends, KVSender and
KVReceiver with their own transfer threads) sits behind these ports, and so
does tensor parallelism: a server's ranks are one group at every TP size (a
server without ranks is a group of one), so the servers never see a rank, a
backend, a byte offset or a wire frame. No call here blocks on the network
except the handshake. ``kvlink.factory`` builds each side from a server's
settings; tests give scripted ones.

A server builds its side with ``notify`` (the engine thread's ``wake``): the
transfer threads call it whenever a transfer ended, and the engine thread
takes what ended between two steps with ``take_finished()``, a list of
``transfer.outcome.TransferEnded`` (one per request, whatever its parts).

Decode side (``ReceiverFactory``)::

    receiver = make_receiver(engine_thread.wake); receiver.start()
    answers = receiver.accept(prefill_hello, timeout_s)   # POST /kv/hello: every rank's answer
    expected = receiver.expect(block_ids, lease_s)        # engine thread, right after engine.reserve
    Reservation(transfer_id=expected.transfer_id, kv_target=expected.target, ...)
    receiver.cancel(tid)                                  # client gone: its TransferEnded follows
    receiver.take_finished()                              # engine thread, between steps

The decode server frees a reservation's blocks only once ``take_finished``
reported its id: with one-sided writes a cancelled transfer may still land
until every sender confirmed it stopped. The receiver enforces the lease.

Prefill side (``PrefillLinkFactory``: the sender and the decode peers it meets)::

    link = make_link(engine_thread.wake); link.sender.start()
    route = await link.peers.route(reservation)           # handshake with its decode server, cached
    link.sender.begin(route, lease_s)                     # engine thread
    link.sender.push_layer(tid, layer, src_block_ids, start, end)   # layer hook: queued, not sent inline
    link.sender.finish(tid, first_tokens)                 # the notice goes once the writes landed
    link.sender.abort(tid)
    tokens = await link.peers.read_prefix(reservation, start, end, timeout_s)   # decode-to-prefill reuse
    link.sender.take_finished()                           # then the prefill server releases the blocks

An outcome is a ``transfer.outcome.Outcome``; the servers pass it on unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from transfer.messages import DecodeGroup
from transfer.outcome import TransferEnded
from wire.kv_target import KVTarget
from wire.replies import Reservation


@dataclass(frozen=True)
class Expected:
    """A transfer a decode server waits for: its id and where a prefill server writes it."""

    transfer_id: str
    target: KVTarget


@dataclass(frozen=True)
class Route:
    """Where one reservation's KV goes, its decode server met: the group of decode ranks (one
    for a server without ranks), each with its transfer id, agent and layout; the blocks."""

    transfer_id: str
    group: DecodeGroup
    block_ids: tuple[int, ...]


class KVReceiverPort(Protocol):
    def start(self) -> None: ...

    def accept(self, sender_hello: bytes, timeout_s: float) -> list[bytes]: ...  # every rank's answer, rank order

    def expect(self, block_ids: list[int], lease_s: float, writable_from: int = 0) -> Expected: ...

    def cancel(self, transfer_id: str) -> None: ...

    def take_finished(self) -> list[TransferEnded]: ...

    def counters(self) -> dict[str, int]: ...  # issued, dropped_expired, checksum_failures, ...

    def open_transfers(self) -> int: ...  # transfers expected and not ended (GET /debug/bookkeeping)

    def problem(self, stuck_after_s: float) -> str | None: ...  # dead or stuck transfer thread (server_common.vitals)

    def close(self) -> None: ...


class KVSenderPort(Protocol):
    def start(self) -> None: ...

    def begin(self, route: Route, lease_s: float) -> None: ...

    def push_layer(self, transfer_id: str, layer: int, src_block_ids: list[int], start: int, end: int) -> None: ...

    def finish(self, transfer_id: str, first_tokens: Sequence[int]) -> None: ...

    def abort(self, transfer_id: str) -> None: ...

    def take_finished(self) -> list[TransferEnded]: ...

    def open_transfers(self) -> int: ...  # transfers begun and not ended (GET /debug/bookkeeping)

    def problem(self, stuck_after_s: float) -> str | None: ...

    def close(self) -> None: ...


class DecodePeersPort(Protocol):
    """A prefill server's decode peers (``kvlink.peers.DecodePeers``). Event loop only."""

    async def route(self, reservation: Reservation) -> Route: ...  # its decode server met if need be

    async def read_prefix(
        self,
        reservation: Reservation,
        start: int,
        end: int,
        timeout_s: float,
        fits: tuple[int, int, int, int] | None = None,
    ) -> Any:
        """Tokens [start, end) of the prefix the reservation pins, read back from its decode server: a
        CPU tensor [layers, K|V, tokens, heads, width], of ``fits`` (layers, 2, heads, width) where given
        (kvlink/prefix_read.py; PrefixReadError: a miss)."""
        ...

    def add(self, name: str, url: str) -> None: ...  # the router announced one (PeerBound: refused)

    def forget(self, name: str) -> bool: ...

    def known(self) -> dict[str, str]: ...

    async def close(self) -> None: ...  # the server stops


@dataclass(frozen=True)
class PrefillLink:
    sender: KVSenderPort
    peers: DecodePeersPort


class PeerMovedOn(RuntimeError):
    """The decode server a reservation names refused the handshake as stale: it is no longer in the role
    epoch that made the reservation (409 ``stale_epoch``), or no longer a decode server (``wrong_role``)."""


Notify = Callable[[], None]
ReceiverFactory = Callable[[Notify], KVReceiverPort]
PrefillLinkFactory = Callable[[Notify], PrefillLink]
