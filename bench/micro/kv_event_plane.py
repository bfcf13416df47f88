"""``python -m bench.micro.kv_event_plane``: what the KV event plane costs, pushed against polled.

``--workers`` event sources (processes serving the servers' own /kv/events, /kv/events/stream and
/kv/blocks routes from server_common/app.py over a real ``KvEventLog``, fed by a thread at
``--rate`` block events a second, as a busy engine's prefix cache would) and ``--routers`` router
stand-ins (processes running the router's own ``KvEventStreams`` or ``KvEventPoller`` into a
``KvIndex``, router/cluster/kv_events.py). For each mode, one after the other on the same sources,
all routers follow all workers for ``--seconds``; then it reports the routers' CPU seconds
(user + system, from getrusage) per thousand events applied (a block stored is one event, a block
evicted another; the sources keep 1000 blocks) and per router as a share of one core, the sources'
CPU over the same window, requests or pages the routers
took, and how far behind each router's index was at the end (events not yet applied). The ratios
poll / push are from this one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from bench.load.cluster import free_ports

REPO = Path(__file__).resolve().parents[2]


def cpu_of(pid: int) -> float:
    """User + system seconds of process ``pid`` (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- an event source: one server's event routes over a log fed at a rate -------------------------


def serve_source(port: int, rate: float, block_size: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    from engine.kv_events import KvEventLog
    from server_common.app import _add_kv_cache_routes

    log = KvEventLog()
    engine = SimpleNamespace(block_size=block_size, cache_salt="bench", prefix_caching=True)
    service = SimpleNamespace(
        kv_events=log, settings=SimpleNamespace(engine=engine), drain=SimpleNamespace(draining=False)
    )
    app = FastAPI()
    _add_kv_cache_routes(app, service)

    def feed() -> None:
        """Stored events at ``rate``, each block evicted 1000 events later (a cache that stays full)."""
        n, t0 = 0, time.monotonic()
        while True:
            due = int((time.monotonic() - t0) * rate)
            while n < due:
                n += 1
                log.stored(n)
                if n > 1000:
                    log.evicted(n - 1000)
            time.sleep(0.01)  # the engine's pace: a step every 10 ms

    threading.Thread(target=feed, daemon=True).start()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ---- a router stand-in: the router's own followers into an index ----------------------------------


async def follow(mode: str, urls: list[str], seconds: float, warmup: float) -> dict:
    from router.cluster.kv_events import KvEventPoller, KvEventStreams
    from router.cluster.kv_index import KvIndex
    from router.cluster.registry import Worker, WorkerRegistry

    registry = WorkerRegistry([Worker(f"w{i}", "decode", url) for i, url in enumerate(urls)])
    for w in registry.workers:
        w.healthy = True
    index = KvIndex()
    requests = 0

    async def count(_: httpx.Request) -> None:
        nonlocal requests
        requests += 1

    async with httpx.AsyncClient(event_hooks={"request": [count]}, limits=httpx.Limits(max_connections=256)) as http:
        runner = KvEventStreams(registry, index, http) if mode == "push" else KvEventPoller(registry, index, http)
        task = asyncio.create_task(runner.run())
        deadline = time.monotonic() + 60.0
        while any(index.of(w.name).stale for w in registry.workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # a benchmark's own pace: every index loaded before the window
        await asyncio.sleep(warmup)
        seq0, req0 = sum(index.of(w.name).seq for w in registry.workers), requests
        pages0 = runner.pages if isinstance(runner, KvEventStreams) else 0
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.sleep(seconds)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        applied = sum(index.of(w.name).seq for w in registry.workers) - seq0
        took_requests = requests - req0
        pages = runner.pages - pages0 if isinstance(runner, KvEventStreams) else took_requests
        lag = []
        for w in registry.workers:
            last = httpx.get(f"{w.url}/kv/events", params={"after": 10**12}).json()["last"]
            lag.append(last - index.of(w.name).seq)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"cpu_s": cpu, "events": applied, "requests": took_requests, "pages": pages, "lag_max": max(lag)}


# ---- the run -------------------------------------------------------------------------------------


def start(argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "bench.micro.kv_event_plane", *argv], env=env, stdout=subprocess.PIPE
    )


def wait_up(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/kv/blocks", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout} s")
        time.sleep(0.1)


def run_mode(mode: str, urls: list[str], sources: list[subprocess.Popen], args: argparse.Namespace) -> dict:
    src0 = sum(cpu_of(p.pid) for p in sources)
    argv = ["follow", mode, ",".join(urls), str(args.seconds), str(args.warmup)]
    routers = [start(argv) for _ in range(args.routers)]
    outs = [json.loads(r.communicate(timeout=args.seconds + args.warmup + 60)[0]) for r in routers]
    src_cpu = sum(cpu_of(p.pid) for p in sources) - src0
    events = sum(o["events"] for o in outs)
    cpu = sum(o["cpu_s"] for o in outs)
    return {
        "mode": mode,
        "router_cpu_s": round(cpu, 3),
        "events_applied": events,
        "router_cpu_ms_per_1k_events": round(1000 * cpu / max(events, 1) * 1000, 3),
        "router_cpu_pct_each": round(100 * cpu / (args.routers * args.seconds), 2),  # of one core, per router
        "router_requests": sum(o["requests"] for o in outs),
        "pages": sum(o["pages"] for o in outs),
        "sources_cpu_s": round(src_cpu, 3),
        "lag_max_events": max(o["lag_max"] for o in outs),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["source"]:
        serve_source(int(argv[1]), float(argv[2]), int(argv[3]))
        return 0
    if argv[:1] == ["follow"]:
        print(json.dumps(asyncio.run(follow(argv[1], argv[2].split(","), float(argv[3]), float(argv[4])))))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.micro.kv_event_plane", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=16, help="event sources (servers)")
    p.add_argument("--routers", type=int, default=4, help="router stand-ins following every source")
    p.add_argument("--rate", type=float, default=50.0, help="block events a second per source")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block event")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per mode")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds after every index loaded, before the window")
    p.add_argument("--out", type=Path, default=None, help="also write the report here as JSON")
    args = p.parse_args(argv)
    ports = free_ports(args.workers)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    sources = [start(["source", str(port), str(args.rate), str(args.block_size)]) for port in ports]
    try:
        for url in urls:
            wait_up(url)
        rows = [run_mode(mode, urls, sources, args) for mode in ("poll", "push")]
    finally:
        for s in sources:
            s.terminate()
        for s in sources:
            s.wait(10)
    poll, push = rows
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "router_cpu_per_event_poll_over_push": round(
            poll["router_cpu_ms_per_1k_events"] / max(push["router_cpu_ms_per_1k_events"], 1e-9), 2
        ),
        "sources_cpu_poll_over_push": round(poll["sources_cpu_s"] / max(push["sources_cpu_s"], 1e-9), 2),
    }
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({k: v for k, v in report.items() if k not in ("rows", "args")}))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
