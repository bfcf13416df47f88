"""The router under load, against stub servers (bench/micro/stubs.py: the internal
protocol, no model): connections are reused, and a busy cluster stays in
rotation however slowly it answers health checks."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.micro.stub_cluster import StubCluster
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

BODY = {"model": "stub", "prompt": "hello there", "max_tokens": 4, "stream": True, "temperature": 0, "ignore_eos": True}


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def test_a_thousand_sequential_requests_reuse_one_connection_per_server(tmp_path):
    # Idle connections outlive the test on both ends: no count depends on how long a request took.
    router = {"worker_keepalive_s": 600}
    with (
        StubCluster(tmp_path, router=router, keep_alive=1200) as cluster,
        httpx.Client(base_url=cluster.router_url, timeout=30) as http,
    ):
        for _ in range(1000):
            r = http.post("/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        decode, prefill = cluster.stats("decode"), cluster.stats("prefill")
    assert decode["requests"] == prefill["requests"] == 1000
    assert decode["aborts"] == prefill["aborts"] == 0
    # One at a time: one decode connection, back in the pool before the client sees the end of its
    # answer. A prefill reply may still be on its way (the router reads it even though the request
    # is done) when the next request starts: then that one opens another connection, reused after.
    assert decode["connections"] == 1
    assert prefill["connections"] <= 4


def test_a_saturated_1p1d_with_health_checks_that_time_out_serves_every_request(tmp_path):
    """While they serve requests, both stubs take 30 s to answer /health (the router's checks give
    up after 1 s); 64 requests in flight at a time, the router's limit per worker. Every request is
    served: no 503 "no healthy ... server" while both servers stream tokens and answer prefills."""
    router = {"health_interval_s": 0.1, "max_inflight_per_worker": 64, "queue_timeout_s": 60}
    with StubCluster(tmp_path, router=router, token_delay=0.01, health_delay=30.0) as cluster:
        statuses: list[int] = []
        errors: list[str] = []

        async def client(http: httpx.AsyncClient, n: int) -> None:
            for _ in range(n):
                r = await http.post("/v1/completions", json={**BODY, "max_tokens": 16})
                statuses.append(r.status_code)
                if r.status_code != 200 or sse_events(r.text)[-1] != "[DONE]" or '"error"' in r.text:
                    errors.append(r.text[:200])

        async def load() -> None:
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(base_url=cluster.router_url, timeout=120, limits=limits) as http:
                await asyncio.gather(*(client(http, 6) for _ in range(64)))

        asyncio.run(load())
        decode = cluster.stats("decode")
    assert errors == [], cluster.log("router")[-2000:]
    assert statuses == [200] * 384
    assert decode["requests"] == 384 and decode["open_streams"] == 0


def test_a_client_that_leaves_mid_stream_is_aborted_on_both_servers(tmp_path):
    with StubCluster(tmp_path, token_delay=0.05) as cluster:
        with httpx.Client(base_url=cluster.router_url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 200}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # one token streamed
        # The client is gone: the router closes the decode stream and aborts the request on both servers.
        aborted_on_both(cluster)


def aborted_on_both(cluster: StubCluster) -> None:
    """The one request a test sent is aborted on both stubs, and the decode stream is closed."""
    wait_until(
        lambda: cluster.stats("decode")["aborts"] == 1 and cluster.stats("prefill")["aborts"] == 1,
        30.0,
        "an abort on both stubs",
    )
    wait_until(lambda: cluster.stats("decode")["open_streams"] == 0, 30.0, "the decode stream closed")
    decode, prefill = cluster.stats("decode"), cluster.stats("prefill")
    assert (decode["requests"], decode["aborts"]) == (1, 1)
    assert (prefill["requests"], prefill["aborts"]) == (1, 1)
