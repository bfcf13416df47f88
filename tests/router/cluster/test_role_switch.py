"""router/cluster/discovery.py's role switch with scripted workers (httpx MockTransport): the calls it
makes and in which order, the worker discovered again in its new role and epoch, and the refusals
(unknown worker or role, the last server of a role, a switch while one is in flight, a worker that
refuses); the role epoch sent with the router's calls (to a server on 127.0.0.1), and a worker that
reports another role taken out of rotation."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from router.cluster.discovery import Discovery, SwitchRefused
from router.cluster.h1_client import H1Client
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.worker_client import WorkerClient, WorkerFailed
from router.metrics import RouterMetrics
from router.settings import DiscoverySettings
from tests.waiting import until
from wire.names import ROLE_EPOCH_HEADER
from wire.requests import GenerateRequest

MODEL = "m0del"
URLS = {"p0": "http://10.0.0.1:8100", "p1": "http://10.0.0.2:8100", "d0": "http://10.0.0.3:8200"}


class Servers:
    """Each server's role and epoch; POST /admin/role switches it (after ``gate`` opens), every other
    call is recorded."""

    def __init__(self, roles: dict[str, str]) -> None:
        self.roles = dict(roles)
        self.epochs = dict.fromkeys(roles, 0)
        self.calls: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.refuse: tuple[int, dict] | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        name = next(n for n, u in URLS.items() if str(request.url).startswith(u))
        path = request.url.path
        if path == "/health":
            report = {"instance": name, "role": self.roles[name], "model": MODEL, "status": "ok"}
            return httpx.Response(200, json=report | {"role_epoch": self.epochs[name], "kv_blocks": {}})
        self.calls.append(f"{request.method} {name}{path}")
        if path == "/admin/role":
            await self.gate.wait()
            if self.refuse is not None:
                return httpx.Response(self.refuse[0], json=self.refuse[1])
            self.roles[name] = json.loads(request.content)["role"]
            self.epochs[name] += 1
            return httpx.Response(200, json={"role": self.roles[name], "role_epoch": self.epochs[name], "seconds": 0.1})
        return httpx.Response(200, json={})


def run(servers: Servers, scenario) -> None:
    registry = WorkerRegistry([])
    for name in ("p0", "p1", "d0"):
        registry.add(Worker(name, "decode" if name.startswith("d") else "prefill", URLS[name], max_inflight=7))
    metrics = RouterMetrics(registry)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
            discovery = Discovery(registry, http, DiscoverySettings(), MODEL, metrics, drain_timeout_s=5.0)
            await scenario(discovery, registry)

    asyncio.run(main())


def test_a_prefill_server_becomes_a_decode_server_and_is_announced_to_the_prefill_servers():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})

    async def scenario(discovery, registry):
        moved = []
        done = await discovery.switch_role("p1", "decode", moved.append)
        worker = done["worker"]
        assert (worker.name, worker.role, worker.role_epoch, worker.max_inflight) == ("p1", "decode", 1, 7)
        assert registry.find("p1") is worker and worker.in_rotation
        assert moved == ["p1"]  # a decode server's streams would move off: it had none as prefill
        assert servers.calls == ["POST p1/admin/role", "POST p0/admin/peers"]
        servers.calls.clear()
        back = await discovery.switch_role("p1", "prefill")
        assert (back["worker"].role, back["worker"].role_epoch) == ("prefill", 2)
        # the prefill servers forget it before it switches; it is told every decode server once it has
        assert servers.calls == ["DELETE p0/admin/peers/p1", "POST p1/admin/role", "POST p1/admin/peers"]

    run(servers, scenario)


def test_refusals_name_their_reason():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})

    async def scenario(discovery, registry):
        cases = [("zz", "decode", 404, "unknown_worker"), ("p1", "router", 400, "unknown_role")]
        cases.append(("d0", "prefill", 409, "no_decode_left"))
        for name, role, status, reason in cases:
            with pytest.raises(SwitchRefused) as refused:
                await discovery.switch_role(name, role)
            assert (refused.value.status, refused.value.reason) == (status, reason)
        await discovery.switch_role("p1", "decode")
        with pytest.raises(SwitchRefused) as last:
            await discovery.switch_role("p0", "decode")
        assert (last.value.status, last.value.reason) == (409, "no_prefill_left")
        assert registry.find("d0").in_rotation and registry.find("p0").in_rotation

    run(servers, scenario)


def test_a_switch_while_one_is_in_flight_is_refused():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    servers.gate.clear()

    async def scenario(discovery, registry):
        first = asyncio.ensure_future(discovery.switch_role("p1", "decode"))
        await until(lambda: "POST p1/admin/role" in servers.calls, what="the first switch reached its worker")
        with pytest.raises(SwitchRefused) as busy:
            await discovery.switch_role("d0", "colocated")
        assert (busy.value.status, busy.value.reason) == (409, "switch_in_progress")
        assert not registry.find("p1").in_rotation  # drained while it switches
        servers.gate.set()
        assert (await first)["worker"].role == "decode"
        assert discovery.switching is None

    run(servers, scenario)


def test_a_worker_that_refuses_stays_in_its_role_and_comes_back_into_rotation():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    servers.refuse = (409, {"error": "p1 is already changing role", "code": "switch_in_progress"})

    async def scenario(discovery, registry):
        with pytest.raises(SwitchRefused) as refused:
            await discovery.switch_role("p1", "decode")
        assert (refused.value.status, refused.value.reason) == (409, "switch_in_progress")
        worker = registry.find("p1")
        assert (worker.role, worker.role_epoch, worker.in_rotation) == ("prefill", 0, True)

    run(servers, scenario)


def test_calls_carry_the_role_epoch_the_router_last_saw_and_a_stale_answer_is_a_refusal():
    seen: list[str | None] = []
    refusal = json.dumps({"error": "d0 is in role epoch 3 (decode)", "code": "stale_epoch"}).encode()

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A decode server on 127.0.0.1 that records each call's epoch header and refuses it."""
        while True:
            head = []
            while (line := await reader.readline()) not in (b"\r\n", b""):
                head.append(line.decode().rstrip("\r\n").split(": ", 1))
            if not head:
                return
            headers = {name.lower(): value for name, value in head[1:]}
            await reader.readexactly(int(headers["content-length"]))
            seen.append(headers.get(ROLE_EPOCH_HEADER.lower()))
            writer.write(b"HTTP/1.1 409 Conflict\r\ncontent-length: %d\r\n\r\n%s" % (len(refusal), refusal))
            await writer.drain()

    async def main() -> WorkerFailed:
        listening = await asyncio.start_server(server, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        async with listening, H1Client(4, 4, 5.0) as http:
            client = WorkerClient(http, prefill_timeout_s=5.0)
            worker = Worker("d0", "decode", f"http://127.0.0.1:{port}")
            request = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling={"max_tokens": 2})
            with pytest.raises(WorkerFailed):
                await client.open_decode(worker, request)  # no epoch reported yet: no header
            worker.apply_health({"role_epoch": 2})
            with pytest.raises(WorkerFailed) as refused:
                await client.open_decode(worker, request)
            return refused.value

    refused = asyncio.run(main())
    assert seen == [None, "2"]
    assert (refused.outcome, refused.never_reached) == ("stale_epoch", True)


def test_a_worker_reporting_another_role_is_taken_out_of_rotation():
    servers = Servers({"p0": "prefill", "p1": "decode", "d0": "decode"})  # p1 switched without this router
    registry = WorkerRegistry([Worker(n, "decode" if n == "d0" else "prefill", URLS[n]) for n in ("p0", "p1", "d0")])

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
            await registry.check_once(http)

    asyncio.run(main())
    assert {w.name: w.healthy for w in registry.workers} == {"p0": True, "p1": False, "d0": True}


def test_a_worker_that_dies_mid_switch_stays_known_out_of_rotation_and_a_switch_brings_it_back():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    dead = {"p1"}

    async def server(request: httpx.Request) -> httpx.Response:
        if any(str(request.url).startswith(URLS[n]) for n in dead):
            if request.url.path == "/admin/role":
                servers.roles["p1"] = "prefill"  # its supervisor starts it again in its configured role
            raise httpx.ConnectError("connection reset")
        return await servers(request)

    async def scenario(discovery, registry):
        with pytest.raises(SwitchRefused) as died:
            await discovery.switch_role("p1", "decode")
        assert (died.value.status, died.value.reason) == (502, "unreachable")
        worker = registry.find("p1")
        assert (worker.role, worker.in_rotation) == ("prefill", False)  # known, not routed to
        dead.clear()  # back up, as configured
        again = await discovery.switch_role("p1", "prefill")
        assert (again["worker"].role, again["worker"].in_rotation) == ("prefill", True)

    registry = WorkerRegistry([])
    for name in ("p0", "p1", "d0"):
        registry.add(Worker(name, "decode" if name.startswith("d") else "prefill", URLS[name]))

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            discovery = Discovery(registry, http, DiscoverySettings(), MODEL, RouterMetrics(registry), 5.0)
            await scenario(discovery, registry)

    asyncio.run(main())
