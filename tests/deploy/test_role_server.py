"""deploy/role_server.py over a mock engine (engine/mock.py), in one process: a role switch in place
keeps the engine and its thread, bumps the role epoch, flips the engine's mode, and stale calls
(another role's path, another epoch) are refused with 409 and a named code."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from deploy.role_server import RoleServer, make_role, roles_serving
from engine.config import EngineConfig
from engine.request import SamplingParams
from server_common.connections import server_guard
from server_common.engine_thread import build_engine
from server_common.settings import ServerSettings
from tests.support.cluster import free_ports
from wire.names import ROLE_EPOCH_HEADER
from wire.requests import GenerateRequest

SECRET = "role-secret"
AUTH = {"authorization": f"Bearer {SECRET}"}


def settings(model: str, role: str) -> ServerSettings:
    port, kv_port = free_ports(2)
    engine = EngineConfig(model=model, kind="mock", num_blocks=64, max_model_len=256, mode=role)
    return ServerSettings(
        name="s0", role=role, engine=engine, port=port, kv_port=kv_port, internal_secret=SECRET, drain_timeout_s=5.0
    )


class Lifespan:
    """The server's ASGI lifespan, as uvicorn drives it: started on entry, shut down on exit."""

    def __init__(self, server: RoleServer) -> None:
        self.server = server
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()

    async def __aenter__(self) -> RoleServer:
        self.task = asyncio.ensure_future(self.server({"type": "lifespan"}, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        assert (await self.outbox.get())["type"] == "lifespan.startup.complete"
        return self.server

    async def __aexit__(self, *exc) -> None:
        await self.inbox.put({"type": "lifespan.shutdown"})
        assert (await self.outbox.get())["type"] == "lifespan.shutdown.complete"
        await self.task


def role_server(model: str, role: str) -> RoleServer:
    s = settings(model, role)
    engine = build_engine(s.engine)
    return RoleServer(s, engine, make_role(s, engine, None, server_guard(s)))


def client(server: RoleServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=server), base_url="http://s0", headers=AUTH)


def test_paths_name_the_roles_that_serve_them():
    assert roles_serving("/prefill") == {"prefill"}
    assert roles_serving("/admin/peers/d1") == {"prefill"}
    assert roles_serving("/generate") == {"decode", "colocated"}
    assert roles_serving("/kv/hello") == {"decode"}
    assert roles_serving("/health") is None and roles_serving("/abort") is None


def test_a_switch_keeps_the_engine_and_its_thread_and_bumps_the_epoch(tiny_model):
    server = role_server(tiny_model, "colocated")
    engine, thread = server.engine, server.engine_thread

    async def main() -> list[tuple]:
        seen = []
        async with Lifespan(server), client(server) as http:
            ident = thread._thread.ident
            for role in ("decode", "prefill", "colocated", "decode"):
                r = await http.post("/admin/role", json={"role": role})
                assert r.status_code == 200, r.text
                health = (await http.get("/health")).json()
                seen.append((r.json()["role_epoch"], health["role"], health["role_epoch"], engine.config.mode))
                assert engine.scheduler.config.mode == role
                assert server.engine_thread is thread and thread._thread.ident == ident and thread.alive
                assert health["kv_blocks"]["free"] == health["kv_blocks"]["total"] == 64
            same = await http.post("/admin/role", json={"role": "decode"})
            assert same.json()["changed"] is False and same.json()["role_epoch"] == 4
        return seen

    seen = asyncio.run(main())
    assert seen == [
        (1, "decode", 1, "decode"),
        (2, "prefill", 2, "prefill"),
        (3, "colocated", 3, "colocated"),
        (4, "decode", 4, "decode"),
    ]
    assert not thread.alive  # the process's shutdown stops it, once


def sample(text: str, name: str) -> float | None:
    """The value of the sample ``name`` (with its labels) in a /metrics page, None where it is absent."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) <= 1, f"{name} is exported {len(values)} times"
    return values[0] if values else None


def test_a_switch_keeps_every_counter_the_earlier_roles_counted(tiny_model):
    server = role_server(tiny_model, "colocated")
    ask = GenerateRequest(
        request_id="g1", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=4), local_prefill=True
    )
    served = 'pdserve_requests_total{outcome="ok"}'

    async def main() -> None:
        async with Lifespan(server), client(server) as http:
            answer = await http.post("/generate", json=ask.model_dump(mode="json"))
            assert answer.status_code == 200, answer.text
            before = (await http.get("/metrics")).text
            assert sample(before, served) == 1 and sample(before, "pdserve_generated_tokens_total") == 4
            for role in ("decode", "prefill", "decode", "colocated"):
                assert (await http.post("/admin/role", json={"role": role})).status_code == 200
                now = (await http.get("/metrics")).text
                assert sample(now, served) == 1 and sample(now, "pdserve_generated_tokens_total") == 4, role
                assert sample(now, "pdserve_connections_open") is not None  # the guard's, once
            # the receivers' discards, exported once however many receivers the process has had
            assert sample(now, 'pdserve_transfers_discarded_total{reason="unknown"}') == 0

    asyncio.run(main())


def test_stale_calls_are_refused_with_409_and_a_named_code(tiny_model):
    server = role_server(tiny_model, "prefill")

    async def main() -> None:
        async with Lifespan(server), client(server) as http:
            wrong = await http.post("/generate", json={})
            assert (wrong.status_code, wrong.json()["code"]) == (409, "wrong_role")
            assert "prefill server now (role epoch 0)" in wrong.json()["error"]
            assert (await http.post("/admin/role", json={"role": "decode"})).status_code == 200
            for path in ("/prefill", "/admin/peers"):
                r = await http.post(path, json={})
                assert (r.status_code, r.json()["code"]) == (409, "wrong_role")
            stale = await http.post("/generate", json={}, headers={ROLE_EPOCH_HEADER: "0"})
            assert (stale.status_code, stale.json()["code"]) == (409, "stale_epoch")
            bad = await http.post("/generate", json={}, headers={ROLE_EPOCH_HEADER: "x"})
            assert (bad.status_code, bad.json()["code"]) == (400, "bad_request")
            current = await http.post("/generate", json={}, headers={ROLE_EPOCH_HEADER: "1"})
            assert current.status_code == 422  # served: the empty body is what it refuses
            anon = await http.post("/prefill", json={}, headers={"authorization": ""})
            assert anon.status_code == 401  # the refusal is behind the internal secret
            assert (await http.get("/admin/role", headers={"authorization": ""})).status_code == 401

    asyncio.run(main())


def test_bad_switches_are_refused(tiny_model):
    server = role_server(tiny_model, "colocated")

    async def main() -> None:
        async with Lifespan(server), client(server) as http:
            unknown = await http.post("/admin/role", json={"role": "router"})
            assert (unknown.status_code, unknown.json()["code"]) == (400, "bad_request")
            async with server._switching:  # a switch in flight
                busy = await http.post("/admin/role", json={"role": "decode"})
            assert (busy.status_code, busy.json()["code"]) == (409, "switch_in_progress")
            assert (await http.get("/admin/role")).json()["role_epoch"] == 0

    asyncio.run(main())


def test_a_switch_waits_for_the_work_in_flight_and_gives_up_after_the_drain_timeout(tiny_model):
    server = role_server(tiny_model, "colocated")
    server.settings = dataclasses.replace(server.settings, drain_timeout_s=0.2)
    sampling = SamplingParams(max_tokens=200, temperature=0.0)

    async def main() -> None:
        async with Lifespan(server), client(server) as http:
            held = await server.engine_thread.run(lambda e: e.add_request("held", [5, 6, 7], sampling))
            assert held is None
            refused = await http.post("/admin/role", json={"role": "prefill"})
            assert (refused.status_code, refused.json()["code"]) == (503, "switch_in_progress")
            assert "it stays a colocated server" in refused.json()["error"]
            assert server.role == "colocated" and server.epoch == 0 and not server.service.drain.draining
            await server.engine_thread.run(lambda e: e.abort("held"))
            assert (await http.post("/admin/role", json={"role": "prefill"})).status_code == 200

    asyncio.run(main())


def test_the_engine_refuses_a_mode_change_while_it_holds_requests(tiny_model):
    engine = build_engine(EngineConfig(model=tiny_model, kind="mock", num_blocks=64, max_model_len=256))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="still holds 1 requests"):
        engine.set_mode("prefill")
    engine.abort("r")
    engine.set_mode("prefill")
    assert engine.config.mode == engine.scheduler.config.mode == "prefill"


def test_a_shutting_down_server_does_not_switch_and_its_drain_follows_the_current_role(tiny_model):
    server = role_server(tiny_model, "colocated")

    async def main() -> None:
        async with Lifespan(server), client(server) as http:
            assert (await http.post("/admin/role", json={"role": "decode"})).status_code == 200
            server.drain.start()  # what SIGTERM does (server_common.run.DrainingServer)
            assert server.service.drain.draining and (await http.get("/health")).json()["status"] == "draining"
            refused = await http.post("/admin/role", json={"role": "prefill"})
            assert (refused.status_code, refused.json()["code"]) == (503, "draining")
            assert await server.drain.wait_idle(1.0)

    asyncio.run(main())
