"""``pdserve bench router``: what the router adds to a request, against stub servers.

One run starts a stub 1P1D cluster (bench/micro/stub_cluster.py: stub servers that
speak pdserve's internal protocol without a model, and the real router), and
sends the same load two ways, side by side:

(a) **direct**: ``POST /generate`` on the decode stub, its NDJSON stream read
    to the end (the floor: one HTTP exchange with the stub);
(b) **router**: ``POST /v1/completions`` (streamed, ``max_tokens`` = tokens,
    ``ignore_eos``) through the router, which opens the decode stream, calls
    the prefill stub, detokenizes and writes SSE.

It reports, at concurrency 1, p50/p99 end-to-end latency and time to first
chunk of each and what the router adds; at concurrency 64 (``--concurrency``)
requests/s and errors of each; and the router process's CPU time per request
and per token (``/proc/<pid>/stat``, user + system) in both phases. ``--token-delay S``
has the decode stub wait before each token event, so that each reaches the router
alone, as an engine's steps send them. ``--profile FILE``
then records the router under the concurrent load with py-spy
(``pip install py-spy``) and prints the functions with the most samples.
``--against CHECKOUT`` instead runs this checkout's router and another's in front of
the same stubs, in turn, and prints both side by side with their ratios.
``--replicas N`` instead compares one router with N behind HAProxy
(``router.replicas``, as `pdserve launch` runs them) under the concurrent load.
The numbers are the machine's: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.micro.stub_cluster import REPO, StubCluster
from engine.request import SamplingParams
from wire.requests import GenerateRequest

PROMPT = "Tell me about the history of the city of Paris in a few sentences."


@dataclass
class Phase:
    """One load against one target."""

    target: str
    concurrency: int
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    e2e_ms: list[float] = field(default_factory=list, repr=False)
    first_chunk_ms: list[float] = field(default_factory=list, repr=False)
    router_cpu_ms: float | None = None  # the router's CPU time over the phase
    error_kinds: collections.Counter = field(default_factory=collections.Counter, repr=False)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def pct(self, values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    def summary(self, tokens: int) -> dict:
        out = {
            "target": self.target,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
            "requests_per_s": round(self.rps, 1),
            "p50_ms": round(self.pct(self.e2e_ms, 50), 3),
            "p99_ms": round(self.pct(self.e2e_ms, 99), 3),
            "first_chunk_p50_ms": round(self.pct(self.first_chunk_ms, 50), 3),
            "first_chunk_p99_ms": round(self.pct(self.first_chunk_ms, 99), 3),
        }
        if self.error_kinds:
            out["error_kinds"] = dict(self.error_kinds.most_common(5))
        if self.router_cpu_ms is not None:
            out["router_cpu_ms_per_request"] = round(self.router_cpu_ms / max(1, self.requests), 3)
            out["router_cpu_us_per_token"] = round(1000 * self.router_cpu_ms / max(1, self.requests * tokens), 1)
        return out


def cpu_ms(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


class Targets:
    def __init__(self, cluster: StubCluster, tokens: int, prompt_ids: list[int]) -> None:
        self.cluster = cluster
        self.tokens = tokens
        self.prompt_ids = prompt_ids
        self._n = 0

    async def direct(self, http: httpx.AsyncClient) -> float:
        """One /generate on the decode stub; returns ms to the first token event."""
        self._n += 1
        body = GenerateRequest(
            request_id=f"direct-{self._n}",
            prompt_token_ids=self.prompt_ids,
            sampling=SamplingParams(max_tokens=self.tokens),
            local_prefill=True,
        ).model_dump_json()
        start = time.perf_counter()
        first = None
        async with http.stream(
            "POST", f"{self.cluster.decode_url}/generate", content=body, headers={"content-type": "application/json"}
        ) as resp:
            resp.raise_for_status()
            seen = 0
            async for line in resp.aiter_lines():
                seen += bool(line)
                if seen == 2 and first is None:  # the reservation, then the first token event
                    first = time.perf_counter()
        if first is None:
            raise RuntimeError("no token event")
        return (first - start) * 1000

    async def router(self, http: httpx.AsyncClient, url: str | None = None) -> float:
        """One streamed completion through the router (or the one at ``url``); returns ms to the first chunk."""
        body = {
            "model": "stub",
            "prompt": PROMPT,
            "max_tokens": self.tokens,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        start = time.perf_counter()
        first = None
        done = False
        async with http.stream("POST", f"{url or self.cluster.router_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if first is None:
                    first = time.perf_counter()
                if line == "data: [DONE]":
                    done = True
                elif '"error"' in line:
                    raise RuntimeError(line)
        if not done or first is None:
            raise RuntimeError("stream ended without [DONE]")
        return (first - start) * 1000


async def run_phase(phase: Phase, call, n: int, router_pid: int | None) -> Phase:
    limits = httpx.Limits(max_connections=phase.concurrency + 8, max_keepalive_connections=phase.concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=60.0) as http:
        queue = iter(range(n))

        async def worker() -> None:
            for _ in queue:
                start = time.perf_counter()
                try:
                    first = await call(http)
                except (httpx.HTTPError, RuntimeError) as exc:
                    phase.errors += 1
                    phase.error_kinds[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                    continue
                phase.e2e_ms.append((time.perf_counter() - start) * 1000)
                phase.first_chunk_ms.append(first)
                phase.requests += 1

        cpu0 = cpu_ms(router_pid) if router_pid else None
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(phase.concurrency)))
        phase.seconds = time.perf_counter() - start
        if cpu0 is not None:
            phase.router_cpu_ms = cpu_ms(router_pid) - cpu0
    return phase


def profile(cluster: StubCluster, targets: Targets, out: Path, concurrency: int, seconds: float) -> list[str]:
    """py-spy on the router while the concurrent load runs; the top functions by own samples."""
    spy = shutil.which("py-spy")
    if spy is None:
        return ["py-spy not found: pip install py-spy"]
    raw = out.with_suffix(".txt")
    proc = subprocess.Popen(
        [
            spy,
            "record",
            "-p",
            str(cluster.router_pid),
            "-d",
            str(int(seconds)),
            "-r",
            "250",
            "-f",
            "raw",
            "-o",
            str(raw),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + seconds

        async def load() -> None:
            while time.monotonic() < deadline:
                await run_phase(Phase("router", concurrency), targets.router, concurrency * 4, None)

        asyncio.run(load())
        proc.wait(timeout=seconds + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not raw.exists():
        return [f"py-spy wrote nothing: {proc.stdout.read().decode(errors='replace')[-500:]}"]
    return top_frames(raw)


def top_frames(raw: Path, n: int = 25) -> list[str]:
    """Functions by own samples and by samples under them, from py-spy's collapsed stacks."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    lines = [f"{total} samples; own time:"]
    lines += [f"  {100 * c / total:5.1f}%  {f}" for f, c in own.most_common(n)]
    lines += ["inclusive (selected):"]
    keys = (
        "connect",
        "_send_single_request",
        "handle_async_request",
        "validate_json",
        "sse_event",
        "encode",
        "decode",
        "model_dump_json",
        "_pump_decode",
        "prefill",
        "text_deltas",
        "push",
        "apply_chat_template",
        "send",
        "receive",
        "_check",
    )
    for f, c in inclusive.most_common():
        if any(k in f.split(" ")[0] for k in keys):
            lines.append(f"  {100 * c / total:5.1f}%  {f}")
            if len(lines) > 2 * n + 2:
                break
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=16, help="tokens per streamed request (default %(default)s)")
    p.add_argument(
        "--requests", type=int, default=300, help="requests per target at concurrency 1 (default %(default)s)"
    )
    p.add_argument("--concurrency", type=int, default=64, help="the concurrent phase's in-flight requests")
    p.add_argument(
        "--concurrent-requests",
        type=int,
        default=2000,
        help="requests per target in the concurrent phase (default %(default)s)",
    )
    p.add_argument(
        "--token-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="the decode stub waits S seconds before each token event, so each reaches the router on its own, "
        "as from an engine's steps (default 0: the events of a request arrive together)",
    )
    p.add_argument("--warmup", type=int, default=50, help="unmeasured requests per target first")
    p.add_argument("--model", type=Path, help="the router's tokenizer folder (default: a byte-level one)")
    p.add_argument("--profile", type=Path, metavar="FILE", help="also record the router with py-spy (FILE.txt)")
    p.add_argument("--profile-seconds", type=float, default=10.0, help="how long --profile records (default 10)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results")
    p.add_argument(
        "--router-pythonpath",
        metavar="DIRS",
        help="put DIRS first on the router's PYTHONPATH (e.g. to compare without uvloop)",
    )
    p.add_argument("--keep", type=Path, metavar="DIR", help="run in DIR and keep the logs (default: a temp dir)")
    p.add_argument(
        "--against",
        type=Path,
        metavar="CHECKOUT",
        help="instead of the phases above: this checkout's router and CHECKOUT's, in front of the same stubs, "
        "in turn for --rounds rounds: what each adds to the stub's p50/p99 at concurrency 1, and under the "
        "concurrent load its requests/s and CPU per token, side by side",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="N",
        help="instead of the phases above: one router, and N routers behind HAProxy (router.replicas, as "
        "`pdserve launch` starts them), in front of the same stubs, under the concurrent load in turn for "
        "--rounds rounds; requests/s of each and their ratio (needs haproxy installed)",
    )
    p.add_argument("--rounds", type=int, default=5, help="rounds of --against or --replicas (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    folder = args.keep or Path(tempfile.mkdtemp(prefix="pdserve-router-bench-"))
    # The concurrent phase must not queue in the router: a slot per request in flight.
    router = {"max_inflight_per_worker": max(args.concurrency, 1) * 2, "max_queued_requests": 4 * args.concurrency}
    with StubCluster(
        folder, router=router, model=args.model, router_pythonpath=args.router_pythonpath, token_delay=args.token_delay
    ) as cluster:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(args.model or folder / "model"))
        targets = Targets(cluster, args.tokens, tok(PROMPT)["input_ids"])
        if args.against is not None:
            result = against(args, cluster, targets)
        elif args.replicas > 1:
            result = replicated(args, cluster, targets)
        else:
            result = phases_of(args, cluster, targets)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def phases_of(args: argparse.Namespace, cluster: StubCluster, targets: Targets) -> dict:
    """The direct and router phases at concurrency 1 and ``args.concurrency`` (and the profile)."""
    pid = cluster.router_pid

    async def measure() -> list[Phase]:
        await run_phase(Phase("direct", 1), targets.direct, args.warmup, None)
        await run_phase(Phase("router", 1), targets.router, args.warmup, None)
        phases = [
            await run_phase(Phase("direct", 1), targets.direct, args.requests, None),
            await run_phase(Phase("router", 1), targets.router, args.requests, pid),
        ]
        c = args.concurrency
        phases.append(await run_phase(Phase("direct", c), targets.direct, args.concurrent_requests, None))
        phases.append(await run_phase(Phase("router", c), targets.router, args.concurrent_requests, pid))
        return phases

    result = report(asyncio.run(measure()), args.tokens)
    if args.profile:
        result["profile"] = profile(cluster, targets, args.profile, args.concurrency, args.profile_seconds)
        print("\n".join(result["profile"]))
    result["connections"] = {"prefill": cluster.stats("prefill"), "decode": cluster.stats("decode")}
    print(f"connections accepted by the stubs: {json.dumps(result['connections'])}")
    return result


def against(args: argparse.Namespace, cluster: StubCluster, targets: Targets) -> dict:
    """This checkout's router and ``args.against``'s in front of the same stubs, in turn every round (the
    order reversed every round): at concurrency 1 each one's p50/p99 over the decode stub's own (measured
    in the same round), and under the concurrent load its requests/s (and over the stub's own) and CPU per
    token; the medians over the rounds and the ratios of this one's to the other's."""
    routers = {"this": (cluster.router_url, cluster.router_pid)}
    url = cluster.add_router("against", args.against.resolve())
    routers["against"] = (url, cluster.procs["against"].pid)
    c, n = args.concurrency, args.concurrent_requests
    samples: dict[str, list[Phase]] = {side: [] for side in routers}  # concurrent phases
    single: dict[str, list[Phase]] = {side: [] for side in [*routers, "direct"]}  # concurrency 1

    async def measure() -> None:
        await run_phase(Phase("direct", 1), targets.direct, args.warmup, None)
        for side, (url, _) in routers.items():
            await run_phase(Phase(side, c), functools.partial(targets.router, url=url), args.warmup, None)
        for r in range(args.rounds):
            order = list(routers)[:: 1 if r % 2 == 0 else -1]
            single["direct"].append(await run_phase(Phase("direct", 1), targets.direct, args.requests, None))
            for side in order:
                url, pid = routers[side]
                call = functools.partial(targets.router, url=url)
                single[side].append(await run_phase(Phase(side, 1), call, args.requests, pid))
            samples.setdefault("direct", []).append(await run_phase(Phase("direct", c), targets.direct, n, None))
            for side in order:
                url, pid = routers[side]
                phase = await run_phase(Phase(side, c), functools.partial(targets.router, url=url), n, pid)
                samples[side].append(phase)

    asyncio.run(measure())
    print(
        f"{args.tokens}-token streamed requests, {args.rounds} rounds: {args.requests} per side at concurrency 1, "
        f"{n} at {c}"
    )
    print(f"  this:    {REPO}\n  against: {args.against.resolve()}")
    med = lambda values: float(np.median(values))  # noqa: E731
    direct_rps = med([p.rps for p in samples["direct"]])
    direct_p50 = med([p.pct(p.e2e_ms, 50) for p in single["direct"]])
    print(f"decode stub alone: p50 {direct_p50:.3f} ms at 1, {direct_rps:.1f} req/s at {c}")
    rows = {}
    for side in routers:
        phases, ones = samples[side], single[side]
        cpu = [p.router_cpu_ms * 1000 / max(1, p.requests * args.tokens) for p in phases if p.router_cpu_ms is not None]
        pairs = list(zip(ones, single["direct"], strict=True))
        rows[side] = {
            "added_p50_ms": round(med([o.pct(o.e2e_ms, 50) - d.pct(d.e2e_ms, 50) for o, d in pairs]), 3),
            "added_p99_ms": round(med([o.pct(o.e2e_ms, 99) - d.pct(d.e2e_ms, 99) for o, d in pairs]), 3),
            "cpu_ms_per_request_c1": round(med([o.router_cpu_ms / max(1, o.requests) for o in ones]), 3),
            "cpu_us_per_token": [round(v, 1) for v in cpu],
            "cpu_us_per_token_median": round(med(cpu), 1),
            "requests_per_s": [round(p.rps, 1) for p in phases],
            "requests_per_s_median": round(med([p.rps for p in phases]), 2),
            "of_direct": round(med([p.rps / d.rps for p, d in zip(phases, samples["direct"], strict=True)]), 3),
            "p50_ms_concurrent": round(med([p.pct(p.e2e_ms, 50) for p in phases]), 2),
            "p99_ms_concurrent": round(med([p.pct(p.e2e_ms, 99) for p in phases]), 2),
            "errors": sum(p.errors for p in phases + ones),
        }
        row = rows[side]
        print(
            f"{side:8} adds p50 {row['added_p50_ms']:6.3f} ms, p99 {row['added_p99_ms']:6.3f} ms at 1 "
            f"({row['cpu_ms_per_request_c1']} ms CPU/req); at {c}: {row['requests_per_s_median']} req/s "
            f"({row['of_direct']}x the stub's), p50 {row['p50_ms_concurrent']} ms, "
            f"CPU {row['cpu_us_per_token_median']:.1f} us/token (rounds {min(cpu):.1f}-{max(cpu):.1f}), "
            f"{row['errors']} errors"
        )
    ratio = rows["this"]["cpu_us_per_token_median"] / rows["against"]["cpu_us_per_token_median"]
    rps_ratio = rows["this"]["requests_per_s_median"] / rows["against"]["requests_per_s_median"]
    print(f"this / against: CPU per token {ratio:.3f}x, requests/s {rps_ratio:.3f}x")
    return {
        "tokens": args.tokens,
        "concurrency": c,
        "direct_requests_per_s_median": round(direct_rps, 2),
        "routers": rows,
        "cpu_ratio_this_over_against": round(ratio, 3),
        "rps_ratio_this_over_against": round(rps_ratio, 3),
    }


def replicated(args: argparse.Namespace, cluster: StubCluster, targets: Targets) -> dict:
    """One router, then ``args.replicas`` routers behind HAProxy, the same concurrent load in turn (the
    order reversed every round): requests/s, p50 and the CPU of the routers and of HAProxy per request,
    and the ratio of the medians' requests/s."""
    front = cluster.add_replicas(args.replicas)
    replicas = [cluster.procs[f"replica-{k}"].pid for k in range(args.replicas)]
    sides = {"1 router": (cluster.router_url, [cluster.router_pid]), f"{args.replicas} routers": (front, replicas)}
    c, n = args.concurrency, args.concurrent_requests
    samples: dict[str, list[tuple[Phase, float, float]]] = {
        side: [] for side in sides
    }  # phase, routers' CPU, HAProxy's

    async def measure() -> None:
        for url, _ in sides.values():
            await run_phase(Phase("warmup", c), functools.partial(targets.router, url=url), args.warmup, None)
        for r in range(args.rounds):
            for side in list(sides)[:: 1 if r % 2 == 0 else -1]:
                url, pids = sides[side]
                cpu0, front0 = sum(cpu_ms(p) for p in pids), cpu_ms(cluster.procs["haproxy"].pid)
                phase = await run_phase(Phase(side, c), functools.partial(targets.router, url=url), n, None)
                routers_cpu = sum(cpu_ms(p) for p in pids) - cpu0
                front_cpu = cpu_ms(cluster.procs["haproxy"].pid) - front0 if pids is replicas else 0.0
                samples[side].append((phase, routers_cpu, front_cpu))

    asyncio.run(measure())
    print(f"{args.tokens}-token streamed requests at concurrency {c}, {n} per side and round, {args.rounds} rounds")
    rows = {}
    for side, runs in samples.items():
        served = max(1, sum(p.requests for p, _, _ in runs))
        rows[side] = {
            "requests_per_s": [round(p.rps, 1) for p, _, _ in runs],
            "requests_per_s_median": round(float(np.median([p.rps for p, _, _ in runs])), 1),
            "p50_ms_median": round(float(np.median([p.pct(p.e2e_ms, 50) for p, _, _ in runs])), 2),
            "routers_cpu_ms_per_request": round(sum(r for _, r, _ in runs) / served, 3),
            "haproxy_cpu_ms_per_request": round(sum(f for _, _, f in runs) / served, 3),
            "errors": sum(p.errors for p, _, _ in runs),
        }
        row = rows[side]
        print(
            f"{side:10} {row['requests_per_s_median']:8} req/s (rounds {min(row['requests_per_s'])}-"
            f"{max(row['requests_per_s'])}), p50 {row['p50_ms_median']} ms, routers' CPU "
            f"{row['routers_cpu_ms_per_request']} ms/req, HAProxy's {row['haproxy_cpu_ms_per_request']} ms/req, "
            f"{row['errors']} errors"
        )
    one, many = rows["1 router"], rows[f"{args.replicas} routers"]
    ratio = many["requests_per_s_median"] / one["requests_per_s_median"]
    print(f"{args.replicas} routers behind HAProxy / 1 router, requests/s: {ratio:.2f}x ({os.cpu_count()} CPUs here)")
    return {
        "tokens": args.tokens,
        "concurrency": c,
        "replicas": args.replicas,
        "cpus": os.cpu_count(),
        "sides": rows,
        "requests_per_s_ratio": round(ratio, 3),
    }


def report(phases: list[Phase], tokens: int) -> dict:
    d1, r1, dc, rc = phases
    added = {
        "p50_ms": round(r1.pct(r1.e2e_ms, 50) - d1.pct(d1.e2e_ms, 50), 3),
        "p99_ms": round(r1.pct(r1.e2e_ms, 99) - d1.pct(d1.e2e_ms, 99), 3),
        "first_chunk_p50_ms": round(r1.pct(r1.first_chunk_ms, 50) - d1.pct(d1.first_chunk_ms, 50), 3),
    }
    rows = [p.summary(tokens) for p in phases]
    print(f"{tokens}-token streamed requests; router CPU from /proc")
    print(
        f"{'target':8} {'conc':>4} {'reqs':>6} {'err':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'1st p50':>8} {'1st p99':>8} {'cpu ms/req':>10} {'cpu us/tok':>10}"
    )
    for s in rows:
        print(
            f"{s['target']:8} {s['concurrency']:>4} {s['requests']:>6} {s['errors']:>4} {s['requests_per_s']:>8} "
            f"{s['p50_ms']:>8} {s['p99_ms']:>8} {s['first_chunk_p50_ms']:>8} {s['first_chunk_p99_ms']:>8} "
            f"{s.get('router_cpu_ms_per_request', ''):>10} {s.get('router_cpu_us_per_token', ''):>10}"
        )
    for s in rows:
        for kind, n in s.get("error_kinds", {}).items():
            print(f"  {s['target']} at {s['concurrency']}: {n} x {kind}")
    print(
        f"router adds at concurrency 1: p50 {added['p50_ms']} ms, p99 {added['p99_ms']} ms, "
        f"first chunk p50 {added['first_chunk_p50_ms']} ms"
    )
    return {"tokens": tokens, "phases": rows, "added_at_concurrency_1": added, "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench router", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
