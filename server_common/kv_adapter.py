"""What the servers add to transfer's KVSender and KVReceiver (which they hold as they are,
through the ports in ``server_common.kv_port``): building them from a server's settings
(backend, layout), and on a prefill server the decode servers it may meet and the handshake
with each (``DecodePeers``: its hello posted to the decode server's ``/kv/hello``, connected
with the answer). Hellos are msgpack bytes made by ``transfer``; they cross HTTP
base64-encoded, never pickled.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from engine import LLMEngine
from engine.kv_cache import KVCache
from server_common.faults import FaultInjector
from server_common.guard import auth_headers
from server_common.kv_port import Notify
from server_common.settings import ServerSettings
from server_common.tp_transfer import RankReceivers, RankSenders
from transfer.messages import DecodeGroup, group_from_target
from transfer.outcome import PeerBound

if TYPE_CHECKING:
    from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


def _layout(engine: LLMEngine):
    return cache_layout(engine.cache)


def cache_layout(c: KVCache):
    """The transfer layout of one rank's KV cache slice."""
    from transfer.layout import KVLayout

    return KVLayout.for_engine_cache(
        num_layers=c.num_layers,
        num_blocks=c.num_blocks,
        block_size=c.block_size,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=c.dtype,
        order=c.order,
        tp_rank=c.tp_rank,
        tp_size=c.tp_size,
        num_kv_heads_total=c.num_kv_heads_total,
    )


def _backend(settings: ServerSettings, listen: bool, faults: FaultInjector | None):
    from transfer.factory import make_backend

    kind = settings.transfer_backend
    if kind == "zmq":
        endpoint = f"tcp://{settings.listen_host}:{settings.kv_port}" if listen else None
        backend = make_backend(
            "zmq",
            settings.name,
            endpoint=endpoint,
            connect_timeout_s=settings.transfer_timeout_s,
            advertise_host=settings.host if listen else None,
        )
    else:
        backend = make_backend(kind, settings.name)
    if faults is None:
        return backend
    from server_common.fault_backend import FaultyBackend

    return FaultyBackend(backend, faults)


class UnknownPeer(ValueError):
    """A reservation names a decode server this cluster neither lists nor was told about by its router."""


class DecodePeers:
    """The decode servers a prefill server may hand KV to, and the handshake with each: once per
    decode server start (concurrent callers share it; a failed one is retried next time; a
    restarted decode server, with a new epoch, is met again, which replaces the connection to its
    dead predecessor). Event loop only."""

    def __init__(self, settings: ServerSettings, sender: RankSenders) -> None:
        self._settings = settings
        self._sender = sender
        self._met: dict[str, tuple[str, asyncio.Task]] = {}  # peer -> (its epoch, handshake)
        # By name: the config's (never re-pointed), and those the router's discovery announced
        # (POST /admin/peers).
        self._configured: dict[str, str] = dict(settings.decode_peers)
        self._known: dict[str, str] = dict(self._configured)
        self._ranks: dict[str, tuple[str, ...]] = {}  # decode server -> its ranks' agent names, as met

    async def ensure(self, target: dict) -> str:
        """The transfer peer for a reservation's ``kv_target`` (``{"peer", "epoch"}``), met if need be."""
        peer, epoch = target["peer"], target.get("epoch", "")
        known = self._met.get(peer)
        task = known[1] if known is not None and known[0] == epoch else None
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.ensure_future(self._handshake(target))
            self._met[peer] = (epoch, task)
        name = await asyncio.shield(task)
        self.check_group(target)
        return name

    async def _handshake(self, target: dict) -> str:
        """Only with a decode server of this cluster, at the address the cluster config (or the
        router's discovery) gives it, never one a reservation names: the secret goes nowhere
        else; and without echoing what it answered."""
        peer = target.get("peer")
        url = self._known.get(peer) if isinstance(peer, str) else None
        if url is None:
            raise UnknownPeer(f"decode server {str(peer)[:64]!r} is not one of this cluster's")
        # one handshake per (prefill rank, decode rank) pair: each prefill rank's hello is accepted
        # by every decode rank (server_common.tp_transfer), whose answers come back in rank order
        sender = self._sender
        hellos = await asyncio.to_thread(sender.rank_hellos)
        answers = []
        async with httpx.AsyncClient(
            timeout=self._settings.transfer_timeout_s, headers=auth_headers(self._settings.internal_secret)
        ) as client:
            for hello in hellos:
                resp = await client.post(f"{url}/kv/hello", json={"hello": base64.b64encode(hello).decode()})
                if resp.status_code != 200:
                    raise RuntimeError(f"decode server {peer} refused the handshake (HTTP {resp.status_code})")
                body = resp.json()
                answers.append([base64.b64decode(h) for h in [body["hello"], *(body.get("ranks") or [])]])
        met = await asyncio.to_thread(sender.connect_ranks, answers, self._settings.transfer_timeout_s)
        if any(names != met[0] for names in met):
            raise RuntimeError(f"decode server {peer} answered the prefill ranks as different groups: {met}")
        self._ranks[peer] = tuple(met[0])
        return met[0][0]

    def check_group(self, target: dict) -> DecodeGroup | None:
        """The decode group a reservation's ``kv_target`` names (None: one rank), once its decode
        server was met: every rank it names must be one that server answered the handshake with
        (ValueError otherwise: the reservation came over the network)."""
        group = group_from_target(target)
        if group is None:
            return None
        met = self._ranks.get(target["peer"], ())
        strangers = [r.peer for r in group.ranks if r.peer not in met]
        if strangers:
            raise ValueError(f"kv_target.tp names agents {strangers[:4]} its decode server did not answer with")
        return group

    def add(self, name: str, url: str) -> None:
        """The router vouches for a decode server that joined (its discovery found it). One the
        config lists keeps the config's address: another raises PeerBound, and nothing changes."""
        configured = self._configured.get(name)
        if configured is not None and url != configured:
            raise PeerBound(f"decode server {name!r} is in the cluster config at {configured}; it is not re-pointed")
        if self._known.get(name) != url:
            self._met.pop(name, None)  # a new address: meet it afresh
        self._known[name] = url

    def forget(self, name: str) -> bool:
        """A decode server left: no handshake with it any more; its transfer state is released."""
        known = self._known.pop(name, None) is not None
        self._met.pop(name, None)
        for agent in self._ranks.pop(name, (name,)):
            self._sender.forget(agent)
        return known

    def known(self) -> dict[str, str]:
        return dict(self._known)


def receiver_factory(
    settings: ServerSettings, engine: LLMEngine, faults: FaultInjector | None = None
) -> Callable[[Notify], KVReceiver | RankReceivers]:
    """What a decode server calls with its engine thread's ``wake`` (``kv_port.ReceiverFactory``):
    a ``KVReceiver``, or with tensor-parallel ranks a ``RankReceivers`` over one per rank (the
    engine's ranks run server_common/tp_rank.py)."""
    from transfer.receiver import KVReceiver

    def make(notify: Notify) -> KVReceiver | RankReceivers:
        local = KVReceiver(
            _backend(settings, listen=True, faults=faults),
            engine.cache.kv,
            _layout(engine),
            name=settings.name,
            model=engine.config.model,
            notify=notify,
        )
        if engine.ranks is None:
            return local
        return RankReceivers(
            local,
            engine.ranks,
            name=settings.name,
            model=engine.config.model,
            backend=settings.transfer_backend,
            timeout_s=settings.transfer_timeout_s,
            host=settings.listen_host,
            advertise=settings.host,
            notify=notify,
        )

    return make


def sender_factory(
    settings: ServerSettings, engine: LLMEngine, faults: FaultInjector | None = None
) -> Callable[[Notify], RankSenders]:
    """What a prefill server calls with its engine thread's ``wake`` (``kv_port.SenderFactory``):
    a ``RankSenders`` over rank 0's ``KVSender`` and, with tensor-parallel ranks, theirs (the
    engine's ranks run server_common/tp_rank.py)."""
    from transfer.sender import KVSender

    def make(notify: Notify) -> RankSenders:
        local = KVSender(
            _backend(settings, listen=False, faults=faults),
            engine.cache.kv,
            _layout(engine),
            name=settings.name,
            model=engine.config.model,
            notify=notify,
        )
        return RankSenders(
            local,
            engine.ranks,
            name=settings.name,
            model=engine.config.model,
            backend=settings.transfer_backend,
            timeout_s=settings.transfer_timeout_s,
            notify=notify,
        )

    return make
