"""What serving adds to a decode step: the engine's own step against the same stream served.

    python -m bench.micro.serve_path [--model smollm2] [--dtype bfloat16] [--threads 2] [--cpus 0,1] \\
        [--prompt-len 128] [--tokens 256] [--rounds 3] [--json FILE]

One colocated cluster (configs/colocated.yaml with the model, dtype, threads
and free ports) runs on ``--cpus``, and beside it, idle while the others run,
one engine in a worker process (bench.micro.decode_step's, pinned to the
same cores). Each round measures, in turn (the order reversed every round),
one request of ``--prompt-len`` prompt tokens and ``--tokens`` output tokens
(``ignore_eos``, greedy, a new prompt each time so no prefix is cached):

- engine: the worker's decode steps for that sequence, ms per step;
- decode server: ``POST /generate`` on the colocated server (local prefill,
  with the cluster's internal secret), its NDJSON stream read here: TPOT = (last token event - first) / (tokens - 1);
- router: the same request as a streamed ``/v1/completions`` through the
  router: TPOT over its SSE chunks the same way.

Both served sides also report CPU time per output token from ``/proc`` (each
thread's ``schedstat``):
the router process, the server's event loop (its main thread) and the
server's other threads (the engine thread and torch's OpenMP workers). On a
machine with as many cores as engine threads, every millisecond the event
loops run is taken from a thread the engine step waits for.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import yaml

from bench.load.cluster import RunningCluster, cpu_list, free_port_pairs, launch
from bench.micro.decode_step import REPO, Side
from server_common.guard import auth_headers

SIDES = ("engine", "decode server", "router")


def _prompt(n: int, salt: int) -> list[int]:
    return [(31 * j + 7 * salt) % 500 + 3 for j in range(n)]


def cluster_config(model: str, dtype: str, threads: int) -> dict:
    data = yaml.safe_load((REPO / "configs" / "colocated.yaml").read_text())
    data["model"], data["dtype"] = model, dtype
    data["engine"] = {**(data.get("engine") or {}), "num_threads": threads}
    ports = free_port_pairs(1 + len(data["colocated"]))
    data["router"] = {**data["router"], "port": ports[0]}
    for inst, port in zip(data["colocated"], ports[1:]):
        inst["port"] = port
    return data


def thread_cpu_ms(pid: int) -> dict[int, float]:
    """CPU time of each thread of ``pid``, in ms: the scheduler's nanoseconds on a CPU (``schedstat``),
    where ``stat``'s clock ticks (10 ms) would be a tenth of what one stream's event loop uses."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e6
        except OSError:
            continue  # the thread ended
    return out


class CpuMeter:
    """CPU per output token of the router, the server's event loop and its other threads, over one request."""

    def __init__(self, router_pid: int, server_pid: int) -> None:
        self.router_pid, self.server_pid = router_pid, server_pid

    def __enter__(self) -> CpuMeter:
        self.router, self.server = thread_cpu_ms(self.router_pid), thread_cpu_ms(self.server_pid)
        return self

    def __exit__(self, *exc) -> None:
        router, server = thread_cpu_ms(self.router_pid), thread_cpu_ms(self.server_pid)
        self.router_ms = sum(router.values()) - sum(self.router.values())
        self.loop_ms = server.get(self.server_pid, 0.0) - self.server.get(self.server_pid, 0.0)
        others = [t for t in server if t != self.server_pid]
        self.engine_ms = sum(server[t] - self.server.get(t, 0.0) for t in others)

    def per_token(self, tokens: int) -> dict[str, float]:
        return {
            "router_cpu_ms": self.router_ms / tokens,
            "server_loop_cpu_ms": self.loop_ms / tokens,
            "server_engine_cpu_ms": self.engine_ms / tokens,
        }


def tpot_ms(stamps: list[float], tokens: int) -> float:
    if len(stamps) < 2 or tokens < 2:
        raise RuntimeError(f"a stream of {tokens} tokens came in {len(stamps)} pieces: no TPOT")
    return (stamps[-1] - stamps[0]) * 1000 / (tokens - 1)


def via_server(url: str, headers: dict[str, str], prompt: list[int], tokens: int, salt: int) -> float:
    """TPOT of one /generate stream read to its end (token events only)."""
    body = {
        "request_id": f"serve-path-{salt}",
        "prompt_token_ids": prompt,
        "sampling": {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
        "local_prefill": True,
    }
    stamps, got = [], 0
    with httpx.stream("POST", url + "/generate", json=body, headers=headers, timeout=600.0) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line:
                continue
            event = json.loads(line)
            if event.get("type") == "error":
                raise RuntimeError(f"/generate failed: {event}")
            if event.get("type") == "tokens" and event.get("token_ids"):
                stamps.append(time.perf_counter())
                got += len(event["token_ids"])
    if got != tokens:
        raise RuntimeError(f"/generate gave {got} tokens, not {tokens}")
    return tpot_ms(stamps, tokens)


def via_router(url: str, model: str, prompt: list[int], tokens: int) -> float:
    """TPOT of one streamed completion through the router, over its text chunks."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stamps, usage = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600.0) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None or usage["completion_tokens"] != tokens:
        raise RuntimeError(f"the router's stream ended with usage {usage}, not {tokens} tokens")
    return tpot_ms(stamps, tokens)


def measure(args: argparse.Namespace, cluster: RunningCluster, engine: Side) -> dict:
    server = next(p for p in cluster.processes() if p["role"] != "router")
    router = next(p for p in cluster.processes() if p["role"] == "router")
    model = httpx.get(cluster.url + "/v1/models", timeout=10.0).json()["data"][0]["id"]
    secret = cluster.run_dir / "internal_secret"  # the launcher's, for a config that names none
    headers = auth_headers(secret.read_text().strip() if secret.is_file() else None)
    tpot: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES[1:]}
    salt = 0

    def one(side: str, tokens: int, keep: bool) -> None:
        nonlocal salt
        salt += 1
        if side == "engine":
            # the worker's ms per decode step (its first decode step untimed)
            ms = engine.run(1, tokens - 2, args.prompt_len)
            if keep:
                tpot[side].append(ms)
            return
        prompt = _prompt(args.prompt_len, 10_000 + salt)
        with CpuMeter(router["pid"], server["pid"]) as meter:
            if side == "decode server":
                ms = via_server(server["url"], headers, prompt, tokens, salt)
            else:
                ms = via_router(cluster.url, model, prompt, tokens)
        if keep:
            tpot[side].append(ms)
            cpu[side].append(meter.per_token(tokens))

    for side in SIDES:  # warm-up, not kept
        one(side, 16, False)
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            one(side, args.tokens, True)
        print(f"   round {r + 1}/{args.rounds} done", flush=True)
    engine_ms = statistics.median(tpot["engine"])
    result: dict = {"samples": {"tpot_ms": tpot, "cpu_per_token": cpu}, "sides": {}}
    for side in SIDES:
        row = {
            "tpot_ms": statistics.median(tpot[side]),
            "range": [min(tpot[side]), max(tpot[side])],
            "vs_engine": statistics.median(tpot[side]) / engine_ms,
        }
        for key in ("router_cpu_ms", "server_loop_cpu_ms", "server_engine_cpu_ms"):
            if side in cpu:
                row[key] = statistics.median(c[key] for c in cpu[side])
        result["sides"][side] = row
    return result


def report(result: dict, args: argparse.Namespace) -> None:
    print(
        f"{args.dtype}, {args.threads} threads, prompt {args.prompt_len}, {args.tokens} tokens, "
        f"{args.rounds} rounds (medians; CPU per output token from /proc)"
    )
    print(
        f"{'side':14} {'TPOT ms':>8} {'range':>15} {'x engine':>9} {'router cpu':>11} "
        f"{'server loop':>12} {'engine thr':>11}"
    )

    def cell(row: dict, key: str, width: int) -> str:
        return f"{row[key]:>{width}.3f}" if key in row else f"{'':>{width}}"

    for side, row in result["sides"].items():
        lo, hi = row["range"]
        print(
            f"{side:14} {row['tpot_ms']:>8.2f} {f'{lo:.2f}-{hi:.2f}':>15} {row['vs_engine']:>8.3f}x "
            f"{cell(row, 'router_cpu_ms', 11)} {cell(row, 'server_loop_cpu_ms', 12)} "
            f"{cell(row, 'server_engine_cpu_ms', 11)}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.micro.serve_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model folder or built-in name (default smollm2)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2, help="the engine's torch threads (both sides)")
    p.add_argument(
        "--cpus", default=None, help="cores for the cluster and the engine, e.g. 0,1 (default: this process's)"
    )
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each request (default 128)")
    p.add_argument("--tokens", type=int, default=256, help="output tokens of each request (default 256)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="write the samples and medians here")
    p.add_argument("--keep", type=Path, metavar="DIR", help="run the cluster in DIR and keep its logs")
    args = p.parse_args(argv)
    if args.tokens < 3:
        p.error("--tokens must be at least 3")
    from engine.models import MODEL_CACHE, resolve_model

    model = str(resolve_model(args.model, MODEL_CACHE))
    cores = cpu_list(args.cpus)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="pdserve-serve-path-"))
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "colocated.yaml"
    config.write_text(yaml.safe_dump(cluster_config(model, args.dtype, args.threads), sort_keys=False))
    print(f"== launching pdserve colocated on cores {cores}", flush=True)
    cluster = launch(config, folder / "run", cores)
    engine = None
    try:
        engine = Side("engine", REPO, SimpleNamespace(model=model, dtype=args.dtype, threads=args.threads), cores)
        result = measure(args, cluster, engine)
    finally:
        if engine is not None:
            engine.close()
        cluster.stop()
    report(result, args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=2))
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
