"""How long a role switch in place takes under load (deploy/role_server.py, router/admin.py).

    python -m bench.micro.role_switch [--engine model|mock] [--model tiny] [--prefill 2] [--decode 2]
        [--switches 6] [--concurrency 6] [--prompt-words 48] [--max-tokens 48] [--json FILE]

``pdserve launch`` starts an xPyD cluster (the real engine, or ``engine.kind: mock``: the real
servers, scheduler, blocks and KV transfer, no model); a closed loop of ``--concurrency`` greedy
completions runs through the router the whole time; meanwhile the router's
``POST /admin/workers/{name}/role`` switches one instance back and forth, ``--switches`` times in
all: the last prefill server to decode and back, then the last decode server to prefill and back.

Reported per switch: the seconds the router's call took (drain out of rotation, the requests it
holds finish or migrate, the server's own switch, discovery again) and the server's own part
(its drain to quiet, the engine handed to the other role's service); their p50 and max; the
requests served and failed over the whole run; every server's KV blocks all free at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import RunningCluster, cpu_list, free_port_pairs, free_ports, launch

SETTLE_S = 1.0  # load between two switches, so each one drains a busy instance


def write_config(folder: Path, args: argparse.Namespace) -> Path:
    """An xPyD cluster on free port pairs, every prompt prefilled remotely (threshold 0)."""
    ports = free_port_pairs(args.prefill + args.decode)
    engine: dict = {"num_threads": 1, "kv_cache_bytes": 16 << 20}
    if args.engine == "mock":
        engine = {"kind": "mock", "num_threads": 1, "num_blocks": 1024}
    data = {
        "model": args.model,
        "max_model_len": 1024,
        "engine": engine,
        "router": {"port": free_ports(1)[0], "health_interval_s": 0.5, "local_prefill_threshold": 0},
        "transfer": {"backend": "zmq"},
        "log_stats_interval_s": 0,
        "prefill": [{"name": f"p{i}", "port": ports[i]} for i in range(args.prefill)],
        "decode": [{"name": f"d{i}", "port": ports[args.prefill + i]} for i in range(args.decode)],
    }
    path = folder / "role-switch.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class Load:
    """A closed loop of greedy completions through the router on its own thread, until stopped."""

    def __init__(self, url: str, model: str, args: argparse.Namespace) -> None:
        self.url, self.model, self.args = url, model, args
        self.ok = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _run(self) -> None:
        words = " ".join(["word"] * self.args.prompt_words)
        async with httpx.AsyncClient(timeout=120.0) as client:

            async def worker(k: int) -> None:
                i = 0
                while not self.stop.is_set():
                    body = {
                        "model": self.model,
                        "prompt": f"{k} {i} {words}",
                        "max_tokens": self.args.max_tokens,
                        "temperature": 0,
                    }
                    try:
                        resp = await client.post(f"{self.url}/v1/completions", json=body)
                        if resp.status_code == 200:
                            self.ok += 1
                        else:
                            self.failures.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
                    except httpx.HTTPError as exc:
                        self.failures.append(repr(exc))
                    i += 1

            await asyncio.gather(*(worker(k) for k in range(self.args.concurrency)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(180)


def blocks_back(cluster: RunningCluster, http: httpx.Client) -> bool:
    for p in cluster.processes():
        if p["role"] != "router":
            b = http.get(p["url"] + "/health").json()["kv_blocks"]
            if b["free"] != b["total"] or b["reserved"] or b["running"]:
                return False
    return True


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The switches: the last prefill server to decode and back, the last decode server to prefill and back."""
    p, d = f"p{args.prefill - 1}", f"d{args.decode - 1}"
    cycle = [(p, "decode"), (p, "prefill"), (d, "prefill"), (d, "decode")]
    return [cycle[i % len(cycle)] for i in range(args.switches)]


def measure(args: argparse.Namespace, run_dir: Path) -> dict:
    config = write_config(run_dir, args)
    cluster = launch(config, run_dir / "run", cpu_list(None), timeout=300.0)
    try:
        secret = (run_dir / "run" / "internal_secret").read_text().strip()
        http = httpx.Client(timeout=120.0, headers={"authorization": f"Bearer {secret}"})
        switches = []
        with Load(cluster.url, cluster.model, args) as load:
            while load.ok < 2 * args.concurrency and not load.failures:
                time.sleep(0.1)  # warm-up: the load is running
            for name, role in plan(args):
                time.sleep(SETTLE_S)  # load on the instance before it switches
                resp = http.post(f"{cluster.url}/admin/workers/{name}/role", json={"role": role})
                if resp.status_code != 200:
                    raise RuntimeError(f"switching {name} to {role}: HTTP {resp.status_code} {resp.text[:300]}")
                body = resp.json()
                switches.append(
                    {"worker": name, "to": role, "seconds": body["seconds"], "server_seconds": body["server_seconds"]}
                )
            time.sleep(SETTLE_S)
        deadline = time.monotonic() + 10
        while not blocks_back(cluster, http) and time.monotonic() < deadline:
            time.sleep(0.1)
        seconds = [s["seconds"] for s in switches]
        server = [s["server_seconds"] for s in switches]
        return {
            "engine": args.engine,
            "model": args.model,
            "servers": {"prefill": args.prefill, "decode": args.decode},
            "concurrency": args.concurrency,
            "switches": switches,
            "switch_seconds": {"p50": round(statistics.median(seconds), 3), "max": round(max(seconds), 3)},
            "server_seconds": {"p50": round(statistics.median(server), 3), "max": round(max(server), 3)},
            "requests_ok": load.ok,
            "requests_failed": len(load.failures),
            "failures": load.failures[:5],
            "blocks_back": blocks_back(cluster, http),
        }
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.role_switch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engine", choices=["model", "mock"], default="model")
    parser.add_argument("--model", default="tiny", help="a built-in model or a folder")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--switches", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    if args.prefill < 2 or args.decode < 2:
        parser.error("--prefill and --decode must be 2 or more: a switch never leaves a role empty")
    with tempfile.TemporaryDirectory(prefix="role-switch-") as tmp:
        result = measure(args, Path(tmp))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result["requests_failed"] == 0 and result["blocks_back"] else 1


if __name__ == "__main__":
    sys.exit(main())
