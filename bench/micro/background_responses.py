"""What keeping a response's events in the store costs the router: background against foreground streams.

    python -m bench.micro.background_responses [--tokens 256] [--requests 32] [--concurrency 8] \\
        [--postgres URL] [--json FILE]

A 1P1D cluster of stub servers (bench/micro/stub_cluster.py) behind the real router, its response store
a SQLite file (or the PostgreSQL database ``--postgres`` names). The same ``/v1/responses`` requests
(``--tokens`` output tokens each, ``--concurrency`` at a time) run twice, in turns: streamed
(``stream: true``), and in the background, each read back as a stream from its first event
(``GET ?stream=true``) until ``response.completed``. Reported per mode: requests/s, the time to the first
text delta (p50) and to the last event (p50), and the ratio background / foreground of the throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.micro.stub_cluster import StubCluster


async def _read(resp: httpx.Response, started: float) -> tuple[float, float]:
    """Seconds from ``started`` to the first text delta and to ``response.completed``."""
    first = None
    async for line in resp.aiter_lines():
        if line.startswith("event: response.output_text.delta") and first is None:
            first = time.perf_counter() - started
        if line.startswith("event: response.completed"):
            return first or 0.0, time.perf_counter() - started
    raise RuntimeError("the stream ended before response.completed")


async def _one(http: httpx.AsyncClient, url: str, tokens: int, background: bool) -> tuple[float, float]:
    body = {"model": "stub", "input": "hello", "max_output_tokens": tokens, "temperature": 0}
    started = time.perf_counter()
    if not background:
        async with http.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}) as resp:
            resp.raise_for_status()
            return await _read(resp, started)
    made = await http.post(f"{url}/v1/responses", json={**body, "background": True})
    made.raise_for_status()
    async with http.stream("GET", f"{url}/v1/responses/{made.json()['id']}", params={"stream": "true"}) as resp:
        resp.raise_for_status()
        return await _read(resp, started)


async def _round(url: str, tokens: int, requests: int, concurrency: int, background: bool) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        gate = asyncio.Semaphore(concurrency)

        async def gated() -> tuple[float, float]:
            async with gate:
                return await _one(http, url, tokens, background)

        started = time.perf_counter()
        times = await asyncio.gather(*(gated() for _ in range(requests)))
        wall = time.perf_counter() - started
    return {
        "requests_per_s": requests / wall,
        "first_delta_p50_ms": 1000 * statistics.median(t[0] for t in times),
        "last_event_p50_ms": 1000 * statistics.median(t[1] for t in times),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="turns of (foreground, background)")
    parser.add_argument("--postgres", help="a PostgreSQL URL for the response store (default: a SQLite file)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = {"url": args.postgres} if args.postgres else {"path": str(Path(tmp) / "responses.sqlite")}
        cluster = StubCluster(Path(tmp) / "cluster", router={"response_store": store})
        try:
            results: dict[str, list[dict]] = {"foreground": [], "background": []}
            for _ in range(args.rounds):
                for mode in ("foreground", "background"):
                    run = _round(cluster.router_url, args.tokens, args.requests, args.concurrency, mode == "background")
                    results[mode].append(asyncio.run(run))
        finally:
            cluster.stop()
    best = {mode: max(rounds, key=lambda r: r["requests_per_s"]) for mode, rounds in results.items()}
    summary = {
        "store": "postgres" if args.postgres else "sqlite",
        "tokens": args.tokens,
        "requests": args.requests,
        "concurrency": args.concurrency,
        **{f"{mode}_{k}": round(v, 2) for mode, r in best.items() for k, v in r.items()},
        "throughput_ratio": round(best["background"]["requests_per_s"] / best["foreground"]["requests_per_s"], 3),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rounds": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
