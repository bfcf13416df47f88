"""Decode-server chaos under load: what a 2P2D cluster's clients see when one decode server is
killed with kill -9 and, once it is back, the other one is drained through the router.

    python3 -m bench.load.chaos --out chaos.json [--code DIR] [--clients 4] [--max-tokens 32]

A bounded mixed load (``--clients`` threads, greedy completions, every other one streamed)
runs against a cluster started with ``pdserve launch`` (restart on failure). The answer to each
prompt is taken from the same cluster before any fault, so every later answer can be judged
exactly. Then: kill -9 of d0; wait until it is restarted and back in rotation; drain d1
(``POST /admin/workers/d1/drain``); wait; resume it; stop the load. Counted: correct answers,
client-visible errors (an error status, or an error event in a stream), wrong answers (a 200
with other text, a cut stream), hung requests (no end within ``--deadline-s``), blocks still
held once the cluster is idle, and the seam: for every streamed request in flight at a fault,
its longest wait between two chunks (p50, p99), against the same for streams with no fault; and
the router's migrations by cause.

``--code DIR`` runs the cluster from another checkout (its ``deploy.cli``), so that two
versions can be compared with the same load: the JSON written to ``--out`` holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import RunningCluster, cpu_list, free_port_pairs, free_ports, launch

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "A prefill server computes the prompt; a decode server streams the answer one token at a time.",
    "Once upon a time there was a small model that wanted to serve many users at once",
    "Numbers one to ten: 1 2 3 4 5 6 7 8 9 10, and then what comes next?",
    "Seven: kill -9 the decode server and see what the client gets back.",
    "Café, naïve, über: multi-byte characters should survive the stream.",
]


def cluster_config(folder: Path, fault_injection: bool = False) -> Path:
    """2P2D of the built-in tiny model on free ports, restart on failure; with ``fault_injection``, the
    servers' /admin/faults (a decode server can be slowed)."""
    pairs = free_port_pairs(4)
    config = {
        **({"fault_injection": True} if fault_injection else {}),
        "model": "tiny",
        "served_model_name": "tiny",
        "engine": {"num_threads": 1, "kv_cache_bytes": 16 << 20},
        "router": {"port": free_ports(1)[0], "health_interval_s": 0.25, "health_backoff_max_s": 0.5},
        "lease_s": 10,
        "drain_timeout_s": 30,
        "transfer": {"backend": "zmq"},
        "restart": {"backoff_s": 0.2},
        "prefill": [{"name": f"p{i}", "port": pairs[i], "block_size": 4} for i in range(2)],
        "decode": [
            {"name": f"d{i}", "port": pairs[2 + i], "block_size": 16, "kv_layout": "NHD" if i else "HND"}
            for i in range(2)
        ],
    }
    path = folder / "chaos-2p2d.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Outcome:
    kind: str  # correct | error | wrong | hung
    stream: bool
    started: float
    ended: float
    gaps: list[float] = field(default_factory=list)  # seconds between the chunks of a stream


class Load:
    def __init__(self, url: str, expected: dict[str, str], clients: int, max_tokens: int, deadline_s: float) -> None:
        self.url, self.expected, self.max_tokens, self.deadline_s = url, expected, max_tokens, deadline_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline_s + 30)

    def _run(self, index: int) -> None:
        n = 0
        with httpx.Client(timeout=self.deadline_s) as http:
            while not self._stop.is_set():
                prompt, stream = PROMPTS[(index + n) % len(PROMPTS)], (index + n) % 2 == 0
                n += 1
                outcome = one(http, self.url, prompt, stream, self.max_tokens, self.expected.get(prompt))
                with self._lock:
                    self.outcomes.append(outcome)


def one(http: httpx.Client, url: str, prompt: str, stream: bool, max_tokens: int, want: str | None) -> Outcome:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started = time.monotonic()
    out = Outcome("wrong", stream, started, started)
    try:
        if not stream:
            resp = http.post(f"{url}/v1/completions", json=body)
            data = resp.json()
            text = data["choices"][0]["text"] if resp.status_code == 200 else None
            out.kind = "error" if text is None else "correct" if want is None or text == want else "wrong"
        else:
            text, last, done = "", time.monotonic(), False
            with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
                if resp.status_code != 200:
                    resp.read()
                    out.kind = "error"
                else:
                    for line in resp.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        now = time.monotonic()
                        out.gaps.append(now - last)
                        last = now
                        if line == "data: [DONE]":
                            done = True
                            break
                        event = json.loads(line[len("data: ") :])
                        if "error" in event:
                            out.kind = "error"
                            break
                        text += event["choices"][0]["text"] if event["choices"] else ""
                    else:
                        out.kind = "wrong"  # cut
                    if done:
                        out.kind = "correct" if want is None or text == want else "wrong"
    except httpx.TimeoutException:
        out.kind = "hung"
    except (httpx.HTTPError, ValueError, KeyError):
        out.kind = "wrong"
    out.ended = time.monotonic()
    return out


def workers(url: str) -> dict[str, dict]:
    return {w["name"]: w for w in httpx.get(f"{url}/health", timeout=10).json()["workers"]}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def held_blocks(cluster: RunningCluster, timeout: float) -> int:
    """Blocks not free on the live servers once idle (0 as soon as every one is free)."""
    deadline = time.monotonic() + timeout
    while True:
        held = 0
        for proc in cluster.processes():
            if proc["role"] == "router":
                continue
            try:
                blocks = httpx.get(proc["url"] + "/health", timeout=5).json()["kv_blocks"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            held += blocks["total"] - blocks["free"]
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run(args: argparse.Namespace) -> dict:
    folder = Path(args.run_dir or tempfile.mkdtemp(prefix="pdserve-chaos-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    config = cluster_config(folder, args.step_delay_s > 0)
    code = args.code.resolve() if args.code else None
    cluster = launch(config, folder / "run", cpu_list(args.cpus), cwd=code)
    secret = folder / "run" / "internal_secret"  # pdserve launch's, for the admin API
    admin = {"authorization": f"Bearer {secret.read_text().strip()}"} if secret.is_file() else {}

    def slow_decodes() -> None:  # each decode server waits this long after every step (server_common.faults)
        for proc in cluster.processes("decode") if args.step_delay_s > 0 else []:
            body = {"step_delay_s": args.step_delay_s}
            httpx.post(f"{proc['url']}/admin/faults", json=body, headers=admin, timeout=10).raise_for_status()

    try:
        url = cluster.url
        slow_decodes()
        with httpx.Client(timeout=args.deadline_s) as http:
            expected = {}
            for prompt in PROMPTS:  # each answer before any fault: what every later one must equal
                body = {"model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                resp = http.post(f"{url}/v1/completions", json={**body, "ignore_eos": True})
                resp.raise_for_status()
                expected[prompt] = resp.json()["choices"][0]["text"]
        load = Load(url, expected, args.clients, args.max_tokens, args.deadline_s)
        load.start()
        time.sleep(args.phase_s)  # the load runs a while: a bench's schedule, not a synchronisation
        d0 = next(p for p in cluster.processes("decode") if p["name"] == "d0")
        faults = [time.monotonic()]
        os.kill(d0["pid"], signal.SIGKILL)
        # Out first, then back: read at once, the router may not have seen the kill yet, and d1 would
        # then be drained while d0 is still restarting (every request 503 until d0 is back).
        wait_for(lambda: not workers(url)["d0"]["in_rotation"], 60, "the router took d0 out of rotation")
        wait_for(lambda: workers(url)["d0"]["in_rotation"], 120, "d0 restarted and back in rotation")
        slow_decodes()  # the restarted d0 too
        time.sleep(args.phase_s)
        faults.append(time.monotonic())
        httpx.post(f"{url}/admin/workers/d1/drain", headers=admin, timeout=30).raise_for_status()
        time.sleep(args.phase_s)
        httpx.post(f"{url}/admin/workers/d1/resume", headers=admin, timeout=30).raise_for_status()
        time.sleep(args.phase_s)
        load.stop()
        held = held_blocks(cluster, 30)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        migrated = {
            line.split('cause="')[1].split('"')[0]: float(line.rpartition(" ")[2])
            for line in metrics.splitlines()
            if line.startswith("pdserve_router_migrations_total{")
        }
    finally:
        cluster.stop()
    outcomes = load.outcomes
    hit = [o for o in outcomes if o.stream and any(o.started < t < o.ended for t in faults)]
    calm = [o for o in outcomes if o.stream and o.kind == "correct" and o not in hit]
    seam = [max(o.gaps) for o in hit if o.kind == "correct" and o.gaps]
    calm_gaps = [max(o.gaps) for o in calm if o.gaps]
    counts = {k: sum(o.kind == k for o in outcomes) for k in ("correct", "error", "wrong", "hung")}
    return {
        "code": str(args.code or Path.cwd()),
        "requests": len(outcomes),
        **counts,
        "errors_in_streams_hit_by_a_fault": sum(o.kind == "error" for o in hit),
        "streams_hit_by_a_fault": len(hit),
        "leaked_blocks": held,
        "migrations": migrated,  # by cause, from the router (none before migration existed)
        "seam_max_gap_s": {"p50": percentile(seam, 50), "p99": percentile(seam, 99), "n": len(seam)},
        "calm_max_gap_s": {"p50": percentile(calm_gaps, 50), "p99": percentile(calm_gaps, 99), "n": len(calm_gaps)},
        "run_dir": str(folder),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.load.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures here (JSON)")
    parser.add_argument("--code", type=Path, help="the checkout whose pdserve runs the cluster (default: this one)")
    parser.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    parser.add_argument("--phase-s", type=float, default=4.0, help="seconds of load around each fault (default 4)")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="a request not done by then hung (default 60)")
    parser.add_argument(
        "--step-delay-s",
        type=float,
        default=0.0,
        help="each decode server waits this long after every step (fault injection), so that streams are in "
        "flight when the faults land however fast the engine decodes (default 0: no delay)",
    )
    parser.add_argument("--cpus", help="cores for the cluster, e.g. 0-1 (default: all this process may use)")
    parser.add_argument("--run-dir", help="where the config and logs go (default: a new temporary folder)")
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
