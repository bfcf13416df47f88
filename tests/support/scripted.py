"""Scripted KV ports for in-process server tests: a test says when and how a
transfer ended (``end``); the server's engine thread takes it between two
steps, as it takes the real sender's and receiver's ended transfers. And the
requests those tests send, and a decode service run in process on a scripted receiver."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client import generate_latest

from decode_server.service import GenerationService
from engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from kvlink.ports import Expected, PrefillLink, Route
from kvlink.prefix_read import PrefixReadError
from server_common.settings import ServerSettings
from tests.waiting import until
from transfer.layout import KVLayout
from transfer.messages import single_rank
from transfer.outcome import Outcome, TransferEnded
from wire.kv_target import KVTarget
from wire.replies import Reservation
from wire.requests import GenerateRequest, PrefillRequest


async def event_lines(stream) -> list[str]:
    """The NDJSON lines of a decode stream, each with its newline, however the writes grouped them."""
    return "".join([chunk async for chunk in stream]).splitlines(keepends=True)


def generate_request(rid: str, n: int = 6, max_tokens: int = 3) -> GenerateRequest:
    """A greedy request for a decode server: an ``n``-token prompt."""
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=list(range(10, 10 + n)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
    )


def prefill_request(rid: str, n: int) -> PrefillRequest:
    """A greedy request for a prefill server: an ``n``-token prompt into a reservation on d0."""
    res = Reservation(
        instance="d0",
        request_id=rid,
        transfer_id=f"t-{rid}",
        block_ids=[3, 4],
        block_size=16,
        num_tokens=n,
        lease_s=30,
        kv_target={"peer": "d0"},
    )
    return PrefillRequest(
        request_id=rid,
        prompt_token_ids=list(range(20, 20 + n)),
        sampling=SamplingParams(max_tokens=4, temperature=0),
        reservation=res,
    )


class ScriptedEnds:
    def __init__(self, notify) -> None:
        self._notify = notify
        self._lock = threading.Lock()
        self._ended: list[TransferEnded] = []
        self.ended_ids: set[str] = set()  # every transfer id reported ended

    def start(self) -> None:
        pass

    def end(self, tid: str, outcome: Outcome, reason: str = "", first_tokens: tuple[int, ...] | None = None) -> None:
        with self._lock:
            self._ended.append(TransferEnded(tid, outcome, reason, first_tokens))
            self.ended_ids.add(tid)
        self._notify()

    def take_finished(self) -> list[TransferEnded]:
        with self._lock:
            out, self._ended = self._ended, []
        return out

    def problem(self, stuck_after_s: float) -> str | None:
        return None

    def close(self) -> None:
        pass


class ScriptedReceiver(ScriptedEnds):
    def __init__(self, notify) -> None:
        super().__init__(notify)
        self.expected: dict[str, list[int]] = {}
        self.writable_from: dict[str, int] = {}
        self.cancelled: list[str] = []

    def expect(self, block_ids, lease_s, writable_from=0) -> Expected:
        tid = f"t{len(self.expected)}"
        self.expected[tid] = list(block_ids)
        self.writable_from[tid] = writable_from
        return Expected(tid, KVTarget(peer="d0", epoch="e"))

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)

    def counters(self) -> dict[str, int]:
        return {"dropped_expired": 2}

    def open_transfers(self) -> int:
        """Expected and not reported ended."""
        return len(set(self.expected) - self.ended_ids)


class ScriptedSender(ScriptedEnds):
    def __init__(self, notify) -> None:
        super().__init__(notify)
        self.calls: list[tuple] = []

    def begin(self, route: Route, lease_s: float) -> None:
        self.calls.append(("begin", route.transfer_id, route.group.ranks[0].peer, list(route.block_ids)))

    def push_layer(self, tid, layer, src_block_ids, start, end) -> None:
        self.calls.append(("push", tid, layer, start, end))

    def finish(self, tid, first_tokens) -> None:
        self.calls.append(("finish", tid, list(first_tokens)))

    def abort(self, tid) -> None:
        self.calls.append(("abort", tid))

    def open_transfers(self) -> int:
        """Begun and not reported ended."""
        return len({c[1] for c in self.calls if c[0] == "begin"} - self.ended_ids)


class ScriptedPeers:
    """A prefill server's decode peers that need no handshake: a reservation's peer is met at once."""

    def __init__(self) -> None:
        self.added: dict[str, str] = {}
        self.reads: list[tuple[str, int, int]] = []

    async def route(self, reservation: Reservation) -> Route:
        """A decode server of one rank with the reservation's own transfer."""
        peer, tid = reservation.kv_target.peer, reservation.transfer_id
        layout = KVLayout(num_layers=1, num_kv_heads_total=1, head_ids=(0,), head_dim=1, block_size=1, num_blocks=1)
        return Route(tid, single_rank(tid, peer, layout), tuple(reservation.block_ids))

    async def read_prefix(
        self,
        reservation: Reservation,
        start: int,
        end: int,
        timeout_s: float,
        fits: tuple[int, int, int, int] | None = None,
    ):
        """No decode server behind it to read a prefix from: every read is a miss (refused), recorded."""
        self.reads.append((reservation.transfer_id, start, end))
        raise PrefixReadError(Outcome.REFUSED, "scripted peers hold no prefix")

    def add(self, name: str, url: str) -> None:
        self.added[name] = url

    def forget(self, name: str) -> bool:
        return self.added.pop(name, None) is not None

    def known(self) -> dict[str, str]:
        return dict(self.added)

    async def close(self) -> None:
        """Nothing to close."""


def scripted_link():
    """A prefill server's link factory (a ScriptedSender, ScriptedPeers) that keeps the sender it
    made: (factory, [sender])."""
    made: list = []

    def factory(notify):
        made.append(ScriptedSender(notify))
        return PrefillLink(made[-1], ScriptedPeers())

    return factory, made


def scripted(cls):
    """A port factory for a server that also keeps the one port it made: (factory, made)."""
    made: list = []

    def factory(notify):
        made.append(cls(notify))
        return made[-1]

    return factory, made


def decode_engine(tiny_model) -> LLMEngine:
    """The decode engine ``run_decode_service`` serves: 8 blocks of 4 tokens."""
    # No prefix caching: the scripted receiver admits reservations whose KV never arrived
    # (test_prefix_cache_service.py runs with caching on).
    return LLMEngine(
        EngineConfig(model=tiny_model, block_size=4, num_blocks=8, num_threads=1, mode="decode", prefix_caching=False)
    )


def run_decode_service(engine, scenario, **settings) -> str:
    """Serve ``engine`` (a decode engine) as decode server d0 with a scripted receiver and ``settings``
    (ServerSettings fields), run ``await scenario(service, receiver)``, then wait until every block is
    free again and check the engine. Returns the service's metrics (Prometheus text)."""
    make_receiver, made = scripted(ScriptedReceiver)
    service = GenerationService(
        ServerSettings(name="d0", role="decode", engine=engine.config, lease_s=5.0, **settings), engine, make_receiver
    )
    (receiver,) = made

    async def main():
        await service.start()
        try:
            await scenario(service, receiver)
            await until(lambda: service.engine_thread.stats.scheduler.free == engine.config.num_blocks)
        finally:
            await service.stop()

    asyncio.run(main())
    engine.check_integrity()
    return generate_latest(service.metrics.registry).decode()


def run_prefill_service(engine, scenario) -> None:
    """Serve ``engine`` (a prefill engine) as prefill server p0 with a scripted sender, run
    ``await scenario(service, sender)``, then wait until every block is free again and check the engine."""
    from prefill_server.service import PrefillService

    make_link, made = scripted_link()
    service = PrefillService(ServerSettings(name="p0", role="prefill", engine=engine.config), engine, make_link)
    (sender,) = made

    async def main():
        await service.start()
        try:
            await scenario(service, sender)
            await until(lambda: service.engine_thread.stats.scheduler.free == engine.config.num_blocks)
        finally:
            await service.stop()

    asyncio.run(main())
    engine.check_integrity()
