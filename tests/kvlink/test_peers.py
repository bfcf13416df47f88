"""kvlink/peers.py: which decode servers a prefill server hands KV to, and the handshake with each.

The handshake runs against a real HTTP server on 127.0.0.1 that answers ``POST /kv/hello``
from a script and records every connection and request, so a test can show that nothing was
sent; the sender is a fake with the four ``RankSenders`` methods ``DecodePeers`` calls. It
meets every decode rank's answer under the answer's own bytes as the agent name."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable

import pytest

from engine.config import EngineConfig
from engine.tensor_parallel import kv_heads_for_rank
from kvlink.peers import DecodePeers, UnknownPeer
from kvlink.ports import Route
from server_common.settings import ServerSettings
from tests.waiting import until
from transfer.layout import KVLayout
from transfer.messages import DecodeGroup, DecodeRank, single_rank
from transfer.outcome import PeerBound
from wire.kv_target import KVTarget
from wire.replies import Reservation

SECRET = "s3cret"


def layout(tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    """A decode rank's cache: 2 KV heads in all, split between ``tp_size`` ranks."""
    return KVLayout.for_engine_cache(
        num_layers=2,
        num_blocks=8,
        block_size=4,
        num_kv_heads=2 // tp_size,
        head_dim=4,
        dtype="float32",
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_kv_heads_total=2,
        head_ids=kv_heads_for_rank(2, tp_rank, tp_size),
    )


LAYOUT = layout()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class HelloServer:
    """``POST /kv/hello`` on 127.0.0.1: ``answer(hello bytes) -> (status, [agent names])`` gives
    the decode server's answer (its rank 0's hello, then its other ranks'). ``gate``, when set,
    holds every answer until it is set."""

    def __init__(self, answer: Callable[[bytes], tuple[int, list[str]]]) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[str, str, dict, dict]] = []  # (method, path, headers, body)
        self.gate: asyncio.Event | None = None
        self.url = ""

    async def __aenter__(self) -> HelloServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                first, *lines = head.split("\r\n")
                method, path, _ = first.split(" ")
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines if ln)}
                body = json.loads(await reader.readexactly(int(headers.get("content-length", "0"))))
                self.requests.append((method, path, headers, body))
                if self.gate is not None:
                    await self.gate.wait()
                status, names = self.answer(base64.b64decode(body["hello"]))
                reply = {"hello": b64(names[0].encode()), "ranks": [b64(n.encode()) for n in names[1:]]}
                data = json.dumps(reply if status == 200 else {"error": "no"}).encode()
                top = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
                writer.write(top.encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its connection
        finally:
            writer.close()


class FakeSender:
    """The RankSenders methods DecodePeers calls, for ``hellos`` prefill ranks (rank r says
    ``p0-r<r>``). Each decode rank's answer is met under its bytes as the agent name."""

    def __init__(self, ranks: int = 1) -> None:
        self.hellos = [f"p0-r{r}".encode() for r in range(ranks)]
        self.hellos_asked = 0
        self.answers: list[list[list[bytes]]] = []
        self.forgotten: list[str] = []

    def rank_hellos(self) -> list[bytes]:
        self.hellos_asked += 1
        return list(self.hellos)

    def connect_ranks(self, answers, timeout_s: float) -> list[list[str]]:
        self.answers.append([list(a) for a in answers])
        return [[a.decode() for a in per_rank] for per_rank in answers]

    def peer_layout(self, peer: str) -> KVLayout:
        return LAYOUT

    def forget(self, peer: str) -> None:
        self.forgotten.append(peer)


def settings(**peers: str) -> ServerSettings:
    return ServerSettings(
        name="p0",
        role="prefill",
        engine=EngineConfig(model="unused"),
        internal_secret=SECRET,
        transfer_timeout_s=5.0,
        decode_peers=tuple(peers.items()),
    )


def reservation(peer: str = "d0", epoch: str = "e1", tid: str = "t1", tp: DecodeGroup | None = None) -> Reservation:
    return Reservation(
        instance=peer,
        request_id="r1",
        transfer_id=tid,
        block_ids=[3, 5],
        block_size=4,
        num_tokens=6,
        lease_s=10.0,
        kv_target=KVTarget(peer=peer, epoch=epoch, tp=tp),
    )


def group(tid: str, *agents: str) -> DecodeGroup:
    """A decode server's ranks as its reservation names them: rank 0's transfer is ``tid``."""
    size = len(agents)
    ranks = tuple(DecodeRank(r, a, tid if r == 0 else f"{tid}.{r}", layout(r, size)) for r, a in enumerate(agents))
    return DecodeGroup(size, ranks)


def one_agent(name: str) -> Callable[[bytes], tuple[int, list[str]]]:
    return lambda hello: (200, [name])


def test_a_configured_decode_server_is_met_once_and_a_server_without_ranks_is_a_group_of_one():
    sender = FakeSender()

    async def run():
        async with HelloServer(one_agent("d0-agent")) as server:
            peers = DecodePeers(settings(d0=server.url), sender)
            first = await peers.route(reservation(tid="t1"))
            second = await peers.route(reservation(tid="t2"))
            return server, first, second

    server, first, second = asyncio.run(run())
    assert first == Route("t1", single_rank("t1", "d0-agent", LAYOUT), (3, 5))
    assert second == Route("t2", single_rank("t2", "d0-agent", LAYOUT), (3, 5))
    assert len(server.requests) == 1  # the second route met no one again
    method, path, headers, body = server.requests[0]
    assert (method, path, body) == ("POST", "/kv/hello", {"hello": b64(b"p0-r0")})
    assert headers["authorization"] == f"Bearer {SECRET}"
    assert sender.answers == [[[b"d0-agent"]]]


def test_a_decode_server_the_cluster_does_not_know_is_refused_and_nothing_is_contacted():
    sender = FakeSender()

    async def run():
        async with HelloServer(one_agent("d0-agent")) as server:
            peers = DecodePeers(settings(d0=server.url), sender)
            with pytest.raises(UnknownPeer, match="'d9' is not one of this cluster's"):
                await peers.route(reservation(peer="d9"))
            return server

    server = asyncio.run(run())
    assert server.connections == 0 and server.requests == []
    assert sender.hellos_asked == 0 and sender.answers == []


def test_a_decode_server_the_router_announced_is_met_and_forgetting_it_makes_it_unknown_again():
    sender = FakeSender()

    async def run():
        async with HelloServer(one_agent("d1-agent")) as server:
            peers = DecodePeers(settings(), sender)
            peers.add("d1", server.url)
            route = await peers.route(reservation(peer="d1"))
            assert peers.forget("d1") is True
            with pytest.raises(UnknownPeer):
                await peers.route(reservation(peer="d1"))
            return server, route, peers

    server, route, peers = asyncio.run(run())
    assert route.group == single_rank("t1", "d1-agent", LAYOUT)
    assert len(server.requests) == 1
    assert sender.forgotten == ["d1-agent"]
    assert peers.known() == {}


def test_a_configured_peer_is_never_re_pointed():
    peers = DecodePeers(settings(d0="http://10.0.0.1:8200"), FakeSender())
    with pytest.raises(PeerBound, match="'d0' is in the cluster config at http://10.0.0.1:8200"):
        peers.add("d0", "http://203.0.113.7:8200")
    assert peers.known() == {"d0": "http://10.0.0.1:8200"}
    peers.add("d0", "http://10.0.0.1:8200")  # the same address: vouched for, nothing changes
    assert peers.known() == {"d0": "http://10.0.0.1:8200"}


def test_an_announced_peer_at_a_new_address_is_met_afresh_there():
    sender = FakeSender()

    async def run():
        async with HelloServer(one_agent("old")) as old, HelloServer(one_agent("new")) as new:
            peers = DecodePeers(settings(), sender)
            peers.add("d1", old.url)
            before = await peers.route(reservation(peer="d1"))
            peers.add("d1", new.url)
            after = await peers.route(reservation(peer="d1"))
            return old, new, before, after

    old, new, before, after = asyncio.run(run())
    assert (before.group.ranks[0].peer, after.group.ranks[0].peer) == ("old", "new")
    assert (len(old.requests), len(new.requests)) == (1, 1)


def test_forget_releases_every_rank_agent_the_handshake_met_by_name():
    sender = FakeSender()

    async def run():
        async with HelloServer(lambda hello: (200, ["d0-r0", "d0-r1"])) as server:
            peers = DecodePeers(settings(d0=server.url), sender)
            route = await peers.route(reservation(tp=group("t1", "d0-r0", "d0-r1")))
            return peers, route

    peers, route = asyncio.run(run())
    assert route == Route("t1", group("t1", "d0-r0", "d0-r1"), (3, 5))
    assert peers.forget("d0") is True
    assert sender.forgotten == ["d0-r0", "d0-r1"]
    assert peers.known() == {}
    assert peers.forget("d0") is False  # gone already


def test_forgetting_a_peer_never_met_releases_its_name():
    sender = FakeSender()
    peers = DecodePeers(settings(d0="http://127.0.0.1:1"), sender)
    assert peers.forget("d0") is True
    assert sender.forgotten == ["d0"]


def test_a_group_naming_agents_the_handshake_did_not_answer_with_is_refused():
    async def run():
        async with HelloServer(lambda hello: (200, ["d0-r0", "d0-r1"])) as server:
            peers = DecodePeers(settings(d0=server.url), FakeSender())
            with pytest.raises(ValueError, match=r"names agents \['elsewhere'\]"):
                await peers.route(reservation(tp=group("t1", "d0-r0", "elsewhere")))

    asyncio.run(run())


def test_rank_0s_transfer_id_must_be_the_reservations():
    async def run():
        async with HelloServer(lambda hello: (200, ["d0-r0", "d0-r1"])) as server:
            peers = DecodePeers(settings(d0=server.url), FakeSender())
            with pytest.raises(ValueError, match="rank 0's transfer id is not the reservation's"):
                await peers.route(reservation(tid="t1", tp=group("t-other", "d0-r0", "d0-r1")))

    asyncio.run(run())


def test_every_prefill_rank_says_hello_and_ranks_answered_as_different_groups_are_refused():
    sender = FakeSender(ranks=2)

    def answer(hello: bytes) -> tuple[int, list[str]]:
        return 200, ["d0-r0", "d0-r1"] if hello == b"p0-r0" else ["d0-r0", "stranger"]

    async def run():
        async with HelloServer(answer) as server:
            peers = DecodePeers(settings(d0=server.url), sender)
            with pytest.raises(RuntimeError, match="answered the prefill ranks as different groups"):
                await peers.route(reservation(tp=group("t1", "d0-r0", "d0-r1")))
            return server

    server = asyncio.run(run())
    assert [body for _, _, _, body in server.requests] == [{"hello": b64(b"p0-r0")}, {"hello": b64(b"p0-r1")}]
    assert sender.answers == [[[b"d0-r0", b"d0-r1"], [b"d0-r0", b"stranger"]]]


def test_a_refused_handshake_fails_the_route_and_the_next_route_tries_again():
    statuses = [403, 200]

    async def run():
        async with HelloServer(lambda hello: (statuses.pop(0), ["d0-agent"])) as server:
            peers = DecodePeers(settings(d0=server.url), FakeSender())
            with pytest.raises(RuntimeError, match=r"d0 refused the handshake \(HTTP 403\)"):
                await peers.route(reservation())
            route = await peers.route(reservation())
            return server, route

    server, route = asyncio.run(run())
    assert route.group == single_rank("t1", "d0-agent", LAYOUT)
    assert len(server.requests) == 2


def test_concurrent_routes_share_one_handshake_and_a_restarted_decode_server_is_met_again():
    names = ["before-restart", "after-restart"]
    sender = FakeSender()

    async def run():
        async with HelloServer(lambda hello: (200, [names.pop(0)])) as server:
            server.gate = asyncio.Event()
            peers = DecodePeers(settings(d0=server.url), sender)
            waiting = [asyncio.create_task(peers.route(reservation(epoch="e1", tid=f"t{i}"))) for i in range(3)]
            await until(lambda: len(server.requests) == 1, what="the first handshake reached the decode server")
            assert not any(t.done() for t in waiting)
            server.gate.set()
            shared = await asyncio.gather(*waiting)
            restarted = await peers.route(reservation(epoch="e2", tid="t9"))
            again = await peers.route(reservation(epoch="e2", tid="t10"))
            return server, shared, restarted, again

    server, shared, restarted, again = asyncio.run(run())
    assert [r.group for r in shared] == [single_rank(f"t{i}", "before-restart", LAYOUT) for i in range(3)]
    assert restarted.group == single_rank("t9", "after-restart", LAYOUT)
    assert again.group == single_rank("t10", "after-restart", LAYOUT)
    assert len(server.requests) == 2  # one per decode server start
    assert sender.hellos_asked == 2
