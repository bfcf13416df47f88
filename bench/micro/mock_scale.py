"""A cluster of mock engines at scale: 32 servers (16 prefill, 16 decode) and one router on this machine.

    python -m bench.micro.mock_scale [--prefill 16] [--decode 16] [--requests 400] [--concurrency 64]
        [--prompt-words 64] [--max-tokens 32] [--profile FILE] [--json FILE]

Every server runs ``engine.kind: mock`` (engine/mock.py): the real server, scheduler, block manager
and KV transfer, no model (hashed tokens, step times from ``--profile`` or the built-in figures).
``pdserve launch`` starts the cluster on the cores this process may use; a closed-loop load of
streamed completions (bench/load/loadgen.py) then goes through the router, every prompt past
``local_prefill_threshold`` 0, so each request is a reservation on a decode server, a prefill on a
prefill server and a KV transfer between them.

Reported: the start time of the whole cluster (launch to every server answering /health), the CPU the
idle cluster uses (router and servers together, over 5 s, in % of one core: health checks), requests/s
and errors, the router's CPU seconds per request and every server's together (``/proc/PID/stat``),
and each server's memory after the load: RSS and PSS (``/proc/PID/smaps_rollup``; PSS shares the
pages of libraries that every server maps, torch's included, between them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import RunningCluster, cpu_list, free_port_pairs, free_ports, launch
from bench.load.loadgen import LoadConfig, PreparedRequest, run_load

IDLE_S = 5.0  # the window the idle cluster's CPU is measured over


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of a process in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            values[key] = int(rest.split()[0]) / 1024
    return values["Rss"], values["Pss"]


def write_config(folder: Path, args: argparse.Namespace) -> Path:
    """The cluster's YAML: ``args.prefill`` + ``args.decode`` mock servers on free port pairs."""
    count = args.prefill + args.decode
    ports = free_port_pairs(count)
    engine: dict = {"kind": "mock", "num_threads": 1, "num_blocks": args.blocks, "max_num_seqs": 64}
    if args.profile:
        engine["mock_profile"] = str(Path(args.profile).resolve())
    data = {
        "model": args.model,
        "max_model_len": 2048,
        "engine": engine,
        "router": {
            "port": free_ports(1)[0],
            "policy": "least_loaded",
            "health_interval_s": 1.0,
            "max_inflight_per_worker": 64,
        },
        "transfer": {"backend": "zmq"},
        "log_stats_interval_s": 0,
        "prefill": [{"name": f"p{i}", "port": ports[i]} for i in range(args.prefill)],
        "decode": [{"name": f"d{i}", "port": ports[args.prefill + i]} for i in range(args.decode)],
    }
    path = folder / "mock-scale.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def wait_all_healthy(cluster: RunningCluster, timeout: float) -> None:
    """Until every server answers /health with 200."""
    deadline = time.monotonic() + timeout
    pending = [p for p in cluster.processes() if p["role"] != "router"]
    with httpx.Client(timeout=2.0) as client:
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout:.0f} s: {[p['name'] for p in pending]}")
            try:
                ok = client.get(pending[0]["url"] + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                pending.pop(0)
            else:
                time.sleep(0.2)


def blocks_back(cluster: RunningCluster) -> bool:
    """Every server holds every block free again."""
    with httpx.Client(timeout=5.0) as client:
        for p in cluster.processes():
            if p["role"] != "router":
                b = client.get(p["url"] + "/health").json()["kv_blocks"]
                if b["free"] != b["total"]:
                    return False
    return True


def measure(args: argparse.Namespace, run_dir: Path) -> dict:
    config = write_config(run_dir, args)
    started = time.monotonic()
    cluster = launch(config, run_dir / "run", cpu_list(args.cores), timeout=args.start_timeout)
    try:
        wait_all_healthy(cluster, args.start_timeout)
        start_s = time.monotonic() - started
        servers = [p for p in cluster.processes() if p["role"] != "router"]
        router = cluster.processes("router")[0]
        everyone = [router, *servers]
        idle_cpu = sum(cpu_seconds(p["pid"]) for p in everyone)
        time.sleep(IDLE_S)  # the measurement's window, nothing waits on it
        idle_cpu = sum(cpu_seconds(p["pid"]) for p in everyone) - idle_cpu
        words = " ".join(["word"] * args.prompt_words)
        load = LoadConfig(
            url=cluster.url,
            model=cluster.model,
            concurrency=args.concurrency,
            num_requests=args.requests,
            request_timeout=120.0,
        )

        def request(i: int) -> PreparedRequest:
            return PreparedRequest(i, f"{i} {words}", args.prompt_words + 1, args.max_tokens)

        router_cpu = cpu_seconds(router["pid"])
        servers_cpu = sum(cpu_seconds(p["pid"]) for p in servers)
        result = asyncio.run(run_load(load, request, warmup=2))
        router_cpu = cpu_seconds(router["pid"]) - router_cpu
        servers_cpu = sum(cpu_seconds(p["pid"]) for p in servers) - servers_cpu
        ok = [r for r in result.records if r.ok]
        deadline = time.monotonic() + 10
        while not blocks_back(cluster) and time.monotonic() < deadline:
            time.sleep(0.1)
        memory = [memory_mib(p["pid"]) for p in servers]
        counts = {
            name: values.get('pdserve_requests_total{outcome="ok"}', 0.0)
            for name, values in cluster.samples("pdserve_requests_total").items()
        }
        return {
            "servers": {"prefill": args.prefill, "decode": args.decode},
            "cores": len(cpu_list(args.cores)),
            "start_s": round(start_s, 1),
            "idle_cpu_percent": round(100 * idle_cpu / IDLE_S, 1),
            "requests": len(result.records),
            "errors": len(result.records) - len(ok),
            "error_kinds": sorted({r.error or "" for r in result.records if not r.ok}),
            "requests_per_s": round(len(ok) / result.duration_s, 2),
            "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / result.duration_s, 1),
            "tokens_per_request": sorted({r.output_tokens for r in ok}),
            "router_cpu_ms_per_request": round(1000 * router_cpu / max(len(ok), 1), 2),
            "servers_cpu_ms_per_request": round(1000 * servers_cpu / max(len(ok), 1), 2),
            "rss_mib": {
                "median": round(statistics.median(m[0] for m in memory), 1),
                "max": round(max(m[0] for m in memory), 1),
            },
            "pss_mib": {
                "median": round(statistics.median(m[1] for m in memory), 1),
                "sum": round(sum(m[1] for m in memory), 1),
            },
            "servers_used": sum(1 for v in counts.values() if v > 0),
            "blocks_back": blocks_back(cluster),
        }
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.mock_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prefill", type=int, default=16)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument(
        "--model", default="tiny", help="a built-in model or a folder; only its config and tokenizer are read"
    )
    parser.add_argument("--profile", help="a `pdserve plan --save-profile` file (default: engine/mock.py's figures)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1024, help="KV blocks per server")
    parser.add_argument("--cores", help="CPU list for the cluster (default: every core this process may use)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mock-scale-") as tmp:
        result = measure(args, Path(tmp))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result["errors"] == 0 and result["blocks_back"] else 1


if __name__ == "__main__":
    sys.exit(main())
