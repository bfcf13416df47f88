"""``python -m bench.micro.tenants``: a light API key beside a heavy one at saturation.

Stub servers (bench/micro/stub_cluster.py: the real router, a decode stub that takes
``--slots`` requests at once and spends ``--token-delay`` per token) and two keys sending
streamed completions as Poisson arrivals: a light key at ``--light-rps`` and a heavy key at
``--heavy-x`` times that, together past what the decode slots serve. Four phases, one after
the other, each ``--seconds`` long, on routers started for them:

1. **alone**: the light key only: its own TTFT, the reference;
2. **fifo**: both keys in one tenant (``router.api_keys`` only): today's first come, first served;
3. **fair**: each key its own tenant of equal weight (``router.tenants``): weighted fair queuing,
   and each tenant's share of the decode slots (router/cluster/fair_share.py); with ``--phases``
   also **queued**, the same without slot shares (``router.tenant_share_window_s: 0``), fair
   queuing alone;
4. **limited**: as fair, the heavy tenant with ``requests_per_minute`` below what it sends, so that
   its excess gets 429 ``rate_limit_exceeded`` with Retry-After at once instead of waiting.

Per phase and key: requests sent, answered, 429s (by code), TTFT p50/p99 of the answered ones,
and throughput (answered/s). Then the ratios the issue asks for, from this one run: the light key's
p99 TTFT against alone (fifo and fair), what it was served against its fair share (max-min: all it
asks for, since that is under half of the slots), the heavy key's answered/s (what fairness costs
it), and the Retry-After the heavy key was given against the limit's refill interval. Reports
written as JSON next to ``--out``.

A phase sends the light key about ``--light-rps`` x ``--seconds`` requests (18 by default), so its
p99 is nearly its slowest one: for a steadier ratio run fewer phases for longer, e.g.
``--phases alone,queued,fair --seconds 45`` (under 3 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.micro.stub_cluster import StubCluster

KEYS = {"light": "sk-bench-light-0001", "heavy": "sk-bench-heavy-0001"}
PHASES = ("alone", "fifo", "queued", "fair", "limited")
DEFAULT_PHASES = ("alone", "fifo", "fair", "limited")


@dataclass
class KeyStats:
    sent: int = 0
    answered: int = 0
    refused: Counter = field(default_factory=Counter)  # 429 code -> count
    errors: int = 0
    ttft_s: list[float] = field(default_factory=list)
    retry_after_s: list[float] = field(default_factory=list)

    def summary(self, seconds: float) -> dict:
        ttft = np.array(self.ttft_s) if self.ttft_s else np.array([float("nan")])
        return {
            "sent": self.sent,
            "answered": self.answered,
            "refused": dict(self.refused),
            "errors": self.errors,
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)) * 1000, 1),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)) * 1000, 1),
            "answered_per_s": round(self.answered / seconds, 3),
            "retry_after_s": sorted(set(self.retry_after_s)),
        }


async def one(http: httpx.AsyncClient, url: str, key: str, max_tokens: int, stats: KeyStats) -> None:
    stats.sent += 1
    body = {"model": "stub", "prompt": "hello there", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    try:
        async with http.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            if resp.status_code == 429:
                error = json.loads(await resp.aread())["error"]
                stats.refused[error["code"]] += 1
                stats.retry_after_s.append(float(resp.headers["retry-after"]))
                return
            if resp.status_code != 200:
                stats.errors += 1
                return
            first = None
            async for line in resp.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic() - t0
            if first is not None:
                stats.ttft_s.append(first)
            stats.answered += 1
    except httpx.HTTPError:
        stats.errors += 1


async def arrivals(url: str, key: str, rps: float, seconds: float, max_tokens: int, seed: int) -> KeyStats:
    """Poisson arrivals at ``rps`` for ``seconds``; waits for every request sent."""
    stats = KeyStats()
    rng = random.Random(seed)
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(http, url, key, max_tokens, stats)))
            await asyncio.sleep(rng.expovariate(rps))
        await asyncio.gather(*tasks)
    return stats


async def phase(url: str, rates: dict[str, float], seconds: float, max_tokens: int) -> dict[str, KeyStats]:
    names = list(rates)
    results = await asyncio.gather(
        *(arrivals(url, KEYS[n], rates[n], seconds, max_tokens, seed=i) for i, n in enumerate(names))
    )
    return dict(zip(names, results, strict=True))


def served(stats: dict) -> float:
    """What a key got of what it asked for: its fair share under max-min fairness, when it asks for
    less than an equal split of the slots."""
    return round(stats["answered"] / stats["sent"], 3)


def router_config(kind: str, slots: int, heavy_rpm: int) -> dict:
    base = {"max_inflight_per_worker": slots, "max_queued_requests": 64, "queue_timeout_s": 20.0}
    if kind == "fifo":
        return {**base, "api_keys": list(KEYS.values())}
    if kind == "queued":
        base["tenant_share_window_s"] = 0.0
    tenants = [{"name": name, "keys": [key]} for name, key in KEYS.items()]
    if kind == "limited":
        tenants[1]["requests_per_minute"] = heavy_rpm
    return {**base, "tenants": tenants}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.micro.tenants", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    p.add_argument("--slots", type=int, default=2, help="requests the decode stub serves at once")
    p.add_argument("--token-delay", type=float, default=0.04, help="the stub's seconds per token")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--light-rps", type=float, default=0.6, help="the light key's arrival rate")
    p.add_argument("--heavy-x", type=float, default=10.0, help="the heavy key's rate, in light rates")
    p.add_argument("--heavy-rpm", type=int, default=60, help="the heavy tenant's limit in the last phase")
    p.add_argument(
        "--phases",
        default=",".join(DEFAULT_PHASES),
        help=f"the phases to run, comma-separated, of {', '.join(PHASES)}; 'alone' always",
    )
    p.add_argument("--out", type=Path, default=Path("bench-tenants.json"))
    args = p.parse_args(argv)
    phases = [k for k in PHASES if k in args.phases.split(",")]
    if "alone" not in phases:
        p.error("--phases: the ratios need 'alone'")
    light = args.light_rps
    rates = {"light": light, "heavy": light * args.heavy_x}
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "phases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in phases:
            config = router_config("fair" if kind == "alone" else kind, args.slots, args.heavy_rpm)
            with StubCluster(Path(tmp) / kind, router=config, token_delay=args.token_delay) as cluster:
                asked = {"light": light} if kind == "alone" else rates
                t0 = time.monotonic()
                stats = asyncio.run(phase(cluster.router_url, asked, args.seconds, args.max_tokens))
                took = time.monotonic() - t0
            report["phases"][kind] = {name: s.summary(took) for name, s in stats.items()}
            print(f"{kind:8s}", json.dumps(report["phases"][kind]), flush=True)
    ph = report["phases"]
    alone_p99 = ph["alone"]["light"]["ttft_p99_ms"]
    ratios: dict = {}
    for kind in ("fifo", "queued", "fair"):
        if kind in ph:
            ratios[f"light_p99_ttft_vs_alone_{kind}"] = round(ph[kind]["light"]["ttft_p99_ms"] / alone_p99, 2)
            ratios[f"light_served_vs_share_{kind}"] = served(ph[kind]["light"])
            ratios[f"heavy_answered_per_s_{kind}"] = ph[kind]["heavy"]["answered_per_s"]
    if "limited" in ph:
        ratios["heavy_429_rate_limited"] = ph["limited"]["heavy"]["refused"].get("rate_limit_exceeded", 0)
        ratios["heavy_retry_after_s"] = ph["limited"]["heavy"]["retry_after_s"]
        ratios["limit_refill_interval_s"] = 60 / args.heavy_rpm
    report["ratios"] = ratios
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(ratios, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
