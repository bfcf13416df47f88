"""router/cluster/discovery.py's ``readmit`` with scripted workers (httpx MockTransport): a known worker
that comes back in another role or role epoch (restarted by ``pdserve launch`` in the role it was last
switched to, deploy/role_file.py), or one lost during a switch that answers again, is out of rotation at
once and joins again as it reports itself, with the prefill servers told as a switch's end tells them;
never while another switch runs."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.cluster.discovery import Discovery, SwitchRefused
from router.cluster.registry import Worker, WorkerRegistry
from router.metrics import RouterMetrics
from router.settings import DiscoverySettings
from tests.router.cluster.test_role_switch import MODEL, URLS, Servers
from tests.waiting import until


class Dying(Servers):
    """``Servers`` whose instances named in ``dead`` refuse connections; a switch call to one of them
    has it restarted in ``restarts_as`` (the role its role file recorded) in the epoch after."""

    def __init__(self, roles: dict[str, str]) -> None:
        super().__init__(roles)
        self.dead: set[str] = set()
        self.restarts_as: dict[str, str] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        name = next(n for n, u in URLS.items() if str(request.url).startswith(u))
        if name in self.dead:
            if request.url.path == "/admin/role":
                self.roles[name] = self.restarts_as[name]
                self.epochs[name] += 1
            raise httpx.ConnectError("connection refused")
        return await super().__call__(request)


def run(servers: Servers, scenario) -> None:
    registry = WorkerRegistry([])
    for name in ("p0", "p1", "d0"):
        registry.add(Worker(name, "decode" if name.startswith("d") else "prefill", URLS[name], max_inflight=7))
    metrics = RouterMetrics(registry)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
            discovery = Discovery(registry, http, DiscoverySettings(), MODEL, metrics, drain_timeout_s=5.0)
            await registry.check_once(http)  # the epochs each reports
            await scenario(discovery, registry, http)

    asyncio.run(main())


async def rejoined(discovery: Discovery, registry: WorkerRegistry, name: str, role: str) -> Worker:
    await until(
        lambda: discovery.switching is None and (w := registry.find(name)) is not None and w.role == role,
        5,
        f"{name} joined again as a {role} server",
    )
    worker = registry.find(name)
    assert worker is not None
    return worker


async def watch(registry: WorkerRegistry, name: str, seen: list) -> None:
    """Notes ``name``'s (role, in rotation) at every turn of the event loop; None when it is unknown."""
    while True:
        worker = registry.find(name)
        seen.append(None if worker is None else (worker.role, worker.in_rotation))
        await asyncio.sleep(0)


def test_a_prefill_server_restarted_as_a_decode_server_joins_again_and_is_announced():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})

    async def scenario(discovery, registry, http):
        servers.roles["p1"], servers.epochs["p1"] = "decode", 2  # restarted in the role it was switched to
        await registry.check_once(http)
        old = registry.find("p1")
        assert old.role == "prefill" and not old.in_rotation  # out at once: never served as a prefill server
        seen = []
        watching = asyncio.create_task(watch(registry, "p1", seen))
        worker = await rejoined(discovery, registry, "p1", "decode")
        watching.cancel()
        assert None not in seen  # known all along: the new view takes the old one's place in one step
        assert ("prefill", True) not in seen  # never in rotation as what it was
        assert (worker.role_epoch, worker.in_rotation, worker.max_inflight) == (2, True, 7)
        assert sorted(w.name for w in registry.healthy("decode")) == ["d0", "p1"]
        assert servers.calls == ["POST p0/admin/peers"]  # p0 may hand it KV now

    run(servers, scenario)


def test_a_decode_server_restarted_in_a_new_epoch_is_met_afresh_by_the_prefill_servers():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})

    async def scenario(discovery, registry, http):
        servers.epochs["d0"] = 1  # a new process, same role
        await registry.check_once(http)
        worker = await rejoined(discovery, registry, "d0", "decode")
        await until(lambda: worker.role_epoch == 1 and worker.in_rotation, 5, "d0 in rotation in epoch 1")
        assert sorted(servers.calls) == sorted(
            ["DELETE p0/admin/peers/d0", "DELETE p1/admin/peers/d0", "POST p0/admin/peers", "POST p1/admin/peers"]
        )
        assert servers.calls.index("DELETE p0/admin/peers/d0") < servers.calls.index("POST p0/admin/peers")
        servers.calls.clear()
        await registry.check_once(http)  # nothing changed since: nothing happens
        assert (servers.calls, registry.find("d0")) == ([], worker)

    run(servers, scenario)


@pytest.mark.parametrize("restarts_as", ["decode", "prefill"])
def test_a_server_that_dies_mid_switch_joins_again_in_the_role_it_restarted_in(restarts_as):
    """Died past its drain: its role file named the new role; before: the old one. Either way it is
    routed to again, in that role, with no further switch."""
    servers = Dying({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    servers.dead, servers.restarts_as = {"p1"}, {"p1": restarts_as}

    async def scenario(discovery, registry, http):
        with pytest.raises(SwitchRefused) as died:
            await discovery.switch_role("p1", "decode")
        assert (died.value.status, died.value.reason) == (502, "unreachable")
        lost = registry.find("p1")
        assert (lost.role, lost.in_rotation, lost.rejoin) == ("prefill", False, True)
        await registry.check_once(http)  # still down: it stays as it is
        assert registry.find("p1") is lost and not lost.in_rotation
        servers.dead.clear()  # the launcher started it again
        servers.calls.clear()
        await registry.check_once(http)
        worker = await rejoined(discovery, registry, "p1", restarts_as)
        assert (worker.role_epoch, worker.in_rotation, worker.rejoin) == (1, True, False)
        told = {"decode": "POST p0/admin/peers", "prefill": "POST p1/admin/peers"}  # announced to p0 / told d0
        assert servers.calls == [told[restarts_as]]

    run(servers, scenario)


def test_no_worker_joins_again_while_another_switches_and_a_later_check_takes_it_back():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})

    async def scenario(discovery, registry, http):
        servers.gate.clear()  # p0's switch waits at the server
        switching = asyncio.create_task(discovery.switch_role("p0", "decode"))
        await until(lambda: servers.calls[-1:] == ["POST p0/admin/role"], 5, "p0's switch is at the server")
        servers.roles["p1"], servers.epochs["p1"] = "decode", 1
        await registry.check_once(http)
        p1 = registry.find("p1")
        assert (p1.role, p1.in_rotation, discovery.switching) == ("prefill", False, "p0")  # out, not joined yet
        servers.gate.set()
        await switching
        await registry.check_once(http)
        worker = await rejoined(discovery, registry, "p1", "decode")
        assert worker.in_rotation and registry.find("p0").role == "decode"

    run(servers, scenario)


def test_a_registry_alone_keeps_a_new_epoch_and_takes_another_role_out():
    servers = Servers({"p0": "prefill", "p1": "decode", "d0": "decode"})
    registry = WorkerRegistry([Worker(n, "decode" if n == "d0" else "prefill", URLS[n]) for n in ("p0", "p1", "d0")])

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as http:
            await registry.check_once(http)
            servers.epochs["d0"] = 4
            await registry.check_once(http)

    asyncio.run(main())
    assert {w.name: (w.healthy, w.role_epoch) for w in registry.workers} == {
        "p0": (True, 0),
        "p1": (False, None),
        "d0": (True, 4),
    }


def test_a_worker_drained_through_the_admin_api_stays_drained_when_it_joins_again():
    servers = Servers({"p0": "prefill", "p1": "prefill", "d0": "decode"})

    async def scenario(discovery, registry, http):
        registry.find("p1").set_draining(True)
        servers.epochs["p1"] = 1
        await registry.check_once(http)
        await until(lambda: registry.find("p1").role_epoch == 1 and discovery.switching is None, 5, "p1 joined again")
        worker = registry.find("p1")
        assert (worker.draining, worker.in_rotation) == (True, False)

    run(servers, scenario)
