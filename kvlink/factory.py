"""Each server's side of the KV link, built from its settings: the transfer backend
(NIXL or ZeroMQ, wrapped for fault injection when the server has it on), its cache's
layout, rank 0's agent here and every other rank's in its own process (``RANK_AGENT``,
the module an engine with ranks runs in each of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine import LLMEngine
from engine.kv_cache import KVCache
from kvlink.messages import Open
from kvlink.ports import KVReceiverPort, Notify, PrefillLink, PrefillLinkFactory, ReceiverFactory
from server_common.faults import FaultInjector
from server_common.settings import ServerSettings

if TYPE_CHECKING:
    from transfer.backend import Backend
    from transfer.layout import KVLayout

RANK_AGENT = "kvlink.agent"  # what a server's tensor-parallel ranks run (engine.tp_worker with its agent)


def cache_layout(c: KVCache) -> KVLayout:
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
        head_ids=c.head_ids,
    )


def _backend(settings: ServerSettings, listen: bool, faults: FaultInjector | None) -> Backend:
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
    from kvlink.faulty_backend import FaultyBackend

    return FaultyBackend(backend, faults)


def _rank0(settings: ServerSettings, engine: LLMEngine) -> dict[str, Any]:
    """Rank 0's agent's cache, its layout, name and model (a KVSender's or KVReceiver's arguments)."""
    return dict(cache=engine.cache.kv, layout=cache_layout(engine.cache), name=settings.name, model=engine.config.model)


def _opening(settings: ServerSettings, engine: LLMEngine, role: str) -> Open:
    """What every other rank opens its agent with (its name is made per rank)."""
    return Open(
        0,
        role,
        settings.transfer_backend,
        settings.name,
        engine.config.model,
        settings.transfer_timeout_s,
        host=settings.listen_host,
        advertise=settings.host,
    )


def receiver_factory(
    settings: ServerSettings, engine: LLMEngine, faults: FaultInjector | None = None
) -> ReceiverFactory:
    """What a decode server calls with its engine thread's ``wake``: a ``RankReceivers`` over
    its ranks' ``KVReceiver``s (one: a server without tensor-parallel ranks)."""

    def make(notify: Notify) -> KVReceiverPort:
        from kvlink.ranks import RankReceivers
        from transfer.receiver import KVReceiver

        local = KVReceiver(_backend(settings, listen=True, faults=faults), **_rank0(settings, engine), notify=notify)
        return RankReceivers(local, engine.ranks, _opening(settings, engine, "decode"), notify)

    return make


def prefill_link_factory(
    settings: ServerSettings, engine: LLMEngine, faults: FaultInjector | None = None
) -> PrefillLinkFactory:
    """What a prefill server calls with its engine thread's ``wake``: a ``RankSenders`` over its
    ranks' ``KVSender``s (one: a server without tensor-parallel ranks) and the decode peers it
    meets with them."""

    def make(notify: Notify) -> PrefillLink:
        from kvlink.peers import DecodePeers
        from kvlink.ranks import RankSenders
        from transfer.sender import KVSender

        local = KVSender(_backend(settings, listen=False, faults=faults), **_rank0(settings, engine), notify=notify)
        sender = RankSenders(local, engine.ranks, _opening(settings, engine, "prefill"), notify)
        return PrefillLink(sender, DecodePeers(settings, sender))

    return make
