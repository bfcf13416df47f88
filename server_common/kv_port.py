"""The small transfer interface the servers are written against.

``transfer/`` (KV layouts, copy plans, NIXL/ZeroMQ backends, KVSender and
KVReceiver with their own transfer threads) sits behind these protocols: the
servers hold a KVSender or KVReceiver as it is (tests: scripted ones);
``server_common.kv_adapter`` builds them from a server's settings and holds a
prefill server's ``DecodePeers`` (which decode servers it may meet, and the
handshake). The servers never see a
backend, a byte offset or a wire frame, and no call here blocks on the network
except the one-time handshake.

A server builds its side with a factory that takes ``notify`` (the engine
thread's ``wake``): the transfer thread calls it whenever a transfer ended,
and the engine thread takes what ended between two steps with
``take_finished()``, a list of ``transfer.outcome.TransferEnded``.

Decode side::

    receiver = make_receiver(engine_thread.wake); receiver.start()
    hello_back = receiver.accept(prefill_hello, timeout_s)   # once per prefill server (POST /kv/hello)
    tid = receiver.expect(block_ids, lease_s)          # engine thread, right after engine.reserve
    receiver.cancel(tid)                               # client gone: its TransferEnded follows
    receiver.take_finished()                           # engine thread, between steps
    receiver.counters()                                # issued, dropped_expired, checksum_failures, ...

The decode server frees a reservation's blocks only once ``take_finished``
reported its id: with one-sided writes a cancelled transfer may still land
until every sender confirmed it stopped. The receiver enforces the lease itself.

Prefill side::

    sender = make_sender(engine_thread.wake); sender.start()
    peer = await peers.ensure(target)                  # handshake with the decode server, cached
    sender.begin(tid, peer, dst_block_ids, lease_s)    # engine thread
    sender.push_layer(tid, layer, src_block_ids, start, end)   # engine layer hook: queued, not sent inline
    sender.finish(tid, first_tokens)                   # the notice goes once the writes landed
    sender.abort(tid)
    sender.take_finished()                             # then the prefill server releases the blocks

An outcome is a ``transfer.outcome.Outcome``; the servers pass it on unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from transfer.outcome import TransferEnded


class KVReceiverPort(Protocol):
    def start(self) -> None: ...

    def accept(self, sender_hello: bytes, timeout_s: float) -> bytes: ...

    def expect(self, block_ids: list[int], lease_s: float, writable_from: int = 0) -> str: ...

    def cancel(self, transfer_id: str) -> None: ...

    def take_finished(self) -> list[TransferEnded]: ...

    def counters(self) -> dict[str, int]: ...

    def open_transfers(self) -> int: ...  # transfers expected and not ended (GET /debug/bookkeeping)

    def problem(self, stuck_after_s: float) -> str | None: ...  # dead or stuck transfer thread (server_common.vitals)

    def close(self) -> None: ...


class KVSenderPort(Protocol):
    def start(self) -> None: ...

    def begin(self, transfer_id: str, peer: str, dst_block_ids: list[int], lease_s: float) -> None: ...

    def push_layer(self, transfer_id: str, layer: int, src_block_ids: list[int], start: int, end: int) -> None: ...

    def finish(self, transfer_id: str, first_tokens: Sequence[int]) -> None: ...

    def abort(self, transfer_id: str) -> None: ...

    def take_finished(self) -> list[TransferEnded]: ...

    def open_transfers(self) -> int: ...  # transfers begun and not ended (GET /debug/bookkeeping)

    def problem(self, stuck_after_s: float) -> str | None: ...

    def close(self) -> None: ...


class DecodePeersPort(Protocol):
    """A prefill server's decode peers (``kv_adapter.DecodePeers``)."""

    async def ensure(self, target: dict) -> str: ...  # the transfer peer for a reservation's kv_target

    def add(self, name: str, url: str) -> None: ...  # the router announced one (PeerBound: refused)

    def forget(self, name: str) -> bool: ...

    def known(self) -> dict[str, str]: ...


Notify = Callable[[], None]
ReceiverFactory = Callable[[Notify], KVReceiverPort]
SenderFactory = Callable[[Notify], KVSenderPort]
