"""Thin adapter from the servers' KV ports to transfer's KVSender/KVReceiver.

What it adds: building the backend and layout from the server's settings,
and the handshake (the prefill server posts its hello to the decode server's
``/kv/hello`` and connects with the answer). Hellos are msgpack bytes made
by ``transfer``; they cross HTTP base64-encoded, never pickled.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections.abc import Sequence

import httpx

from engine import LLMEngine
from server_common.faults import FaultInjector
from server_common.guard import auth_headers
from server_common.kv_port import Notify
from server_common.settings import ServerSettings
from transfer.outcome import PeerBound, TransferEnded

log = logging.getLogger(__name__)


def _layout(engine: LLMEngine):
    from transfer.layout import KVLayout

    c = engine.cache
    return KVLayout.for_engine_cache(num_layers=c.num_layers, num_blocks=c.num_blocks, block_size=c.block_size,
                                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=c.dtype,
                                     order=c.order)


def _backend(settings: ServerSettings, listen: bool, faults: FaultInjector | None):
    from transfer.registry import make_backend

    kind = settings.transfer_backend
    if kind == "zmq":
        endpoint = f"tcp://{settings.listen_host}:{settings.kv_port}" if listen else None
        backend = make_backend("zmq", settings.name, endpoint=endpoint, connect_timeout_s=settings.transfer_timeout_s,
                               advertise_host=settings.host if listen else None)
    else:
        backend = make_backend(kind, settings.name)
    if faults is None:
        return backend
    from server_common.fault_backend import FaultyBackend

    return FaultyBackend(backend, faults)


class UnknownPeer(ValueError):
    """A reservation names a decode server this cluster neither lists nor was told about by its router."""


class ReceiverAdapter:
    def __init__(self, settings: ServerSettings, engine: LLMEngine, notify: Notify,
                 faults: FaultInjector | None = None) -> None:
        from transfer.receiver import KVReceiver

        self._settings = settings
        self._receiver = KVReceiver(_backend(settings, listen=True, faults=faults), engine.cache.kv,
                                    _layout(engine), name=settings.name, model=engine.config.model, notify=notify)
        # Changes with every start: a prefill server that sees a new epoch meets this server afresh.
        self._epoch = secrets.token_hex(8)

    def start(self) -> None:
        self._receiver.start()

    def take_finished(self) -> list[TransferEnded]:
        return self._receiver.take_finished()

    def accept(self, sender_hello: bytes) -> bytes:
        return self._receiver.accept(sender_hello, timeout_s=self._settings.transfer_timeout_s)

    def expect(self, block_ids: list[int], lease_s: float, writable_from: int = 0) -> str:
        return self._receiver.expect(block_ids, lease_s, writable_from=writable_from)

    def target(self) -> dict:
        return {"peer": self._settings.name, "epoch": self._epoch}

    def cancel(self, transfer_id: str) -> None:
        self._receiver.cancel(transfer_id)

    def counters(self) -> dict[str, int]:
        return self._receiver.counters()

    def problem(self, stuck_after_s: float) -> str | None:
        return self._receiver.problem(stuck_after_s)

    def close(self) -> None:
        self._receiver.close()


class SenderAdapter:
    def __init__(self, settings: ServerSettings, engine: LLMEngine, notify: Notify,
                 faults: FaultInjector | None = None) -> None:
        from transfer.sender import KVSender

        self._settings = settings
        self._sender = KVSender(_backend(settings, listen=False, faults=faults), engine.cache.kv, _layout(engine),
                                name=settings.name, model=engine.config.model, notify=notify)
        self._peers: dict[str, tuple[str, asyncio.Task]] = {}  # peer -> (its epoch, handshake); event loop only
        # Decode servers this prefill server may meet, by name: the config's (never re-pointed), and
        # those the router's discovery announced (POST /admin/peers); event loop only.
        self._configured: dict[str, str] = dict(settings.decode_peers)
        self._known: dict[str, str] = dict(self._configured)

    def start(self) -> None:
        self._sender.start()

    def take_finished(self) -> list[TransferEnded]:
        return self._sender.take_finished()

    async def ensure_peer(self, target: dict) -> str:
        """Handshake once per decode server start (concurrent callers share it): a failed one is
        retried next time, and a restarted decode server (new epoch) is met again, which
        replaces the connection to its dead predecessor."""
        peer, epoch = target["peer"], target.get("epoch", "")
        known = self._peers.get(peer)
        task = known[1] if known is not None and known[0] == epoch else None
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.ensure_future(self._handshake(target))
            self._peers[peer] = (epoch, task)
        return await asyncio.shield(task)

    async def _handshake(self, target: dict) -> str:
        """Only with a decode server of this cluster, at the address the cluster config (or the
        router's discovery) gives it, never one a reservation names: the secret goes nowhere
        else; and without echoing what it answered."""
        peer = target.get("peer")
        url = self._known.get(peer) if isinstance(peer, str) else None
        if url is None:
            raise UnknownPeer(f"decode server {str(peer)[:64]!r} is not one of this cluster's")
        hello = base64.b64encode(self._sender.hello()).decode()
        async with httpx.AsyncClient(timeout=self._settings.transfer_timeout_s,
                                     headers=auth_headers(self._settings.internal_secret)) as client:
            resp = await client.post(f"{url}/kv/hello", json={"hello": hello})
        if resp.status_code != 200:
            raise RuntimeError(f"decode server {peer} refused the handshake (HTTP {resp.status_code})")
        answer = base64.b64decode(resp.json()["hello"])
        return await asyncio.to_thread(self._sender.connect, answer, self._settings.transfer_timeout_s)

    def add_peer(self, name: str, url: str) -> None:
        """The router vouches for a decode server that joined (its discovery found it). One the
        config lists keeps the config's address: another raises PeerBound, and nothing changes."""
        configured = self._configured.get(name)
        if configured is not None and url != configured:
            raise PeerBound(f"decode server {name!r} is in the cluster config at {configured}; it is not re-pointed")
        if self._known.get(name) != url:
            self._peers.pop(name, None)  # a new address: meet it afresh
        self._known[name] = url

    def forget_peer(self, name: str) -> bool:
        """A decode server left: no handshake with it any more; its transfer state is released."""
        known = self._known.pop(name, None) is not None
        self._peers.pop(name, None)
        self._sender.forget(name)
        return known

    def known_peers(self) -> dict[str, str]:
        return dict(self._known)

    def begin(self, transfer_id: str, peer: str, dst_block_ids: list[int], lease_s: float) -> None:
        self._sender.begin(transfer_id, peer, dst_block_ids, lease_s)

    def push_layer(self, transfer_id: str, layer: int, src_block_ids: list[int], start: int, end: int) -> None:
        self._sender.push_layer(transfer_id, layer, src_block_ids, start, end)

    def finish(self, transfer_id: str, first_tokens: Sequence[int]) -> None:
        self._sender.finish(transfer_id, first_tokens)

    def abort(self, transfer_id: str) -> None:
        self._sender.abort(transfer_id)

    def problem(self, stuck_after_s: float) -> str | None:
        return self._sender.problem(stuck_after_s)

    def close(self) -> None:
        self._sender.close()


def receiver_factory(settings: ServerSettings, engine: LLMEngine, faults: FaultInjector | None = None):
    """What a decode server calls with its engine thread's ``wake`` (``kv_port.ReceiverFactory``)."""
    return lambda notify: ReceiverAdapter(settings, engine, notify, faults)


def sender_factory(settings: ServerSettings, engine: LLMEngine, faults: FaultInjector | None = None):
    """What a prefill server calls with its engine thread's ``wake`` (``kv_port.SenderFactory``)."""
    return lambda notify: SenderAdapter(settings, engine, notify, faults)
