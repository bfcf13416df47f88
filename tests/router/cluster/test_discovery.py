"""router/cluster/discovery.py with scripted workers (httpx MockTransport) and a scripted
resolver: who joins, who is refused and why, and how a worker leaves."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import generate_latest

from router.cluster.discovery import Discovery
from router.cluster.registry import WorkerRegistry
from router.metrics import RouterMetrics
from router.settings import DiscoverySettings

MODEL = "m0del"


class Workers:
    """Health reports by address; records every other call (the /admin/peers announcements)."""

    def __init__(self, reports: dict[str, dict]) -> None:
        self.reports = reports
        self.calls: list[tuple[str, str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/health":
            if base not in self.reports:
                raise httpx.ConnectError("refused")
            return httpx.Response(200, json=self.reports[base])
        self.calls.append(
            (request.method, base, request.url.path + (f" {request.content.decode()}" if request.content else ""))
        )
        return httpx.Response(200, json={})


def report(name: str, role: str, model: str = MODEL) -> dict:
    return {
        "instance": name,
        "role": role,
        "model": model,
        "status": "ok",
        "kv_blocks": {"free": 8, "reserved": 0, "running": 0, "total": 8},
    }


def run(workers: Workers, dns: dict[str, list[str]], scenario) -> RouterMetrics:
    registry = WorkerRegistry([])
    metrics = RouterMetrics(registry)

    async def resolve(host: str) -> list[str]:
        return dns.get(host, [])

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(workers)) as http:
            settings = DiscoverySettings(kind="dns", names=("decode.svc:8200", "prefill.svc:8100"), interval_s=60)
            discovery = Discovery(registry, http, settings, MODEL, metrics, drain_timeout_s=5.0, resolve=resolve)
            await scenario(discovery, registry)

    asyncio.run(main())
    return metrics


def sample(metrics: RouterMetrics, line_start: str) -> float:
    text = generate_latest(metrics.registry).decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start + " "))


def test_addresses_dns_finds_join_and_each_decode_server_is_announced_to_the_prefill_servers():
    workers = Workers(
        {
            "http://10.1.0.1:8200": report("d0", "decode"),
            "http://10.1.0.2:8200": report("d1", "decode"),
            "http://10.1.0.3:8100": report("p0", "prefill"),
        }
    )
    dns = {"decode.svc": ["10.1.0.1", "10.1.0.2"], "prefill.svc": ["10.1.0.3"]}

    async def scenario(discovery, registry):
        await discovery.resolve_once()
        assert sorted((w.name, w.role, w.url) for w in registry.workers) == [
            ("d0", "decode", "http://10.1.0.1:8200"),
            ("d1", "decode", "http://10.1.0.2:8200"),
            ("p0", "prefill", "http://10.1.0.3:8100"),
        ]
        # d0 and d1 joined before p0: p0 is told both when it joins
        assert sorted(workers.calls) == [
            ("POST", "http://10.1.0.3:8100", '/admin/peers {"name":"d0","url":"http://10.1.0.1:8200"}'),
            ("POST", "http://10.1.0.3:8100", '/admin/peers {"name":"d1","url":"http://10.1.0.2:8200"}'),
        ]
        await discovery.resolve_once()  # nothing changed: nothing happens
        assert len(registry.workers) == 3 and len(workers.calls) == 2

    metrics = run(workers, dns, scenario)
    assert sample(metrics, "pdserve_router_workers_joined_total") == 3


def test_another_model_a_name_in_use_and_a_silent_address_are_refused_and_counted():
    workers = Workers(
        {
            "http://10.1.0.1:8200": report("d0", "decode"),
            "http://10.1.0.2:8200": report("d0", "decode"),  # same name, other address
            "http://10.1.0.3:8200": report("d9", "decode", model="other"),
        }
    )
    dns = {"decode.svc": ["10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.4"]}

    async def scenario(discovery, registry):
        await discovery.resolve_once()
        assert [(w.name, w.url) for w in registry.workers] == [("d0", "http://10.1.0.1:8200")]

    metrics = run(workers, dns, scenario)
    assert sample(metrics, 'pdserve_router_workers_refused_total{reason="name_in_use"}') == 1
    assert sample(metrics, 'pdserve_router_workers_refused_total{reason="other_model"}') == 1
    assert sample(metrics, 'pdserve_router_workers_refused_total{reason="no_health_report"}') == 1


def test_an_address_dns_no_longer_gives_is_drained_then_forgotten_everywhere():
    workers = Workers(
        {
            "http://10.1.0.1:8200": report("d0", "decode"),
            "http://10.1.0.2:8200": report("d1", "decode"),
            "http://10.1.0.3:8100": report("p0", "prefill"),
        }
    )
    dns = {"decode.svc": ["10.1.0.1", "10.1.0.2"], "prefill.svc": ["10.1.0.3"]}

    async def scenario(discovery, registry):
        await discovery.resolve_once()
        d1 = registry.find("d1")
        d1.inflight = 1  # a request still streaming from it
        dns["decode.svc"] = ["10.1.0.1"]
        await discovery.resolve_once()
        await asyncio.sleep(0.2)
        assert registry.find("d1") is d1 and d1.draining and not d1.in_rotation  # no new work, not gone yet
        d1.inflight = 0  # its request finished
        for _ in range(100):
            if registry.find("d1") is None:
                break
            await asyncio.sleep(0.02)
        assert [w.name for w in registry.workers] == ["d0", "p0"]
        assert workers.calls[-1] == ("DELETE", "http://10.1.0.3:8100", "/admin/peers/d1")

    metrics = run(workers, dns, scenario)
    assert sample(metrics, "pdserve_router_workers_left_total") == 1


def test_a_worker_whose_name_is_no_name_is_refused_and_every_joined_worker_can_leave():
    names = ["", "../../admin/workers", ".", "..", "a b", "x" * 65, None, 7]
    workers = Workers(
        {f"http://10.1.0.{i + 1}:8200": report(name, "decode") for i, name in enumerate(names)}
        | {"http://10.1.0.99:8200": report("d-0.ok_1", "decode")}
    )
    dns = {"decode.svc": [f"10.1.0.{i + 1}" for i in range(len(names))] + ["10.1.0.99"]}

    async def scenario(discovery, registry):
        await discovery.resolve_once()
        assert [w.name for w in registry.workers] == ["d-0.ok_1"]
        await discovery.leave("d-0.ok_1")
        assert registry.workers == []

    metrics = run(workers, dns, scenario)
    assert sample(metrics, 'pdserve_router_workers_refused_total{reason="bad_name"}') == len(names)
