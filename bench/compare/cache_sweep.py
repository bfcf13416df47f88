"""Prefix caching side by side on 1P2D: caching off, on with round-robin, on with cache_aware.

    python3 -m bench.compare.cache_sweep --model DIR [--workload shared|multi-turn] [--out DIR]

Each variant is a fresh cluster from configs/1p2d.yaml (the model, caching and the
router policy changed), sent the same requests (bench/load/prefix_workload.py) by the
load client; afterwards each server's counters are read. Printed per variant:
TTFT p50/p99, request throughput, the decode servers' prefix hit rate (hits over
looked-up prompt tokens, ``pdserve_prefix_cache_*_tokens_total``) next to the best
the workload allows (``PrefixWorkload.best_hit_rate``), the prefill server's, and
the KV bytes the prefill server sent per request (``pdserve_transfer_bytes_total``).
A script, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import yaml

from bench.load.cluster import free_port_pairs, launch
from bench.load.loadgen import LoadConfig, run_load
from bench.load.metrics import summarize
from bench.load.prefix_workload import PrefixWorkload
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.serve import request_source
from bench.load.workload import LengthDist

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "off": (False, "round_robin"),
    "on+round_robin": (True, "round_robin"),
    "on+cache_aware": (True, "cache_aware"),
}


def config_for(model: str, caching: bool, policy: str, local_prefill_threshold: int | None = None) -> dict:
    """configs/1p2d.yaml with ``model``, prefix caching on or off, ``policy``, one torch thread, free ports;
    ``local_prefill_threshold`` when given (the router's: shorter uncached parts are prefilled on D)."""
    data = yaml.safe_load((REPO / "configs" / "1p2d.yaml").read_text())
    data["model"] = model
    data["engine"] = {**(data.get("engine") or {}), "prefix_caching": caching, "num_threads": 1}
    data["router"] = {**data["router"], "policy": policy}
    if local_prefill_threshold is not None:
        data["router"]["local_prefill_threshold"] = local_prefill_threshold
    instances = [*data["prefill"], *data["decode"]]
    ports = free_port_pairs(1 + len(instances))
    data["router"]["port"] = ports[0]
    for inst, port in zip(instances, ports[1:]):
        inst["port"], inst["kv_port"] = port, port + 1
    return data


def counter(samples: dict, server: str, name: str) -> float:
    """The sum of a counter's samples (every label set) on one server."""
    return sum(v for k, v in samples.get(server, {}).items() if k == name or k.startswith(name + "{"))


def run_variant(name: str, args, workload: PrefixWorkload, builder: PromptBuilder) -> dict:
    caching, policy = VARIANTS[name]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    path = out / "1p2d.yaml"
    path.write_text(yaml.safe_dump(config_for(args.model, caching, policy), sort_keys=False))
    cluster = launch(path, out / "run", sorted(os.sched_getaffinity(0)))
    try:
        config = LoadConfig(
            url=cluster.url,
            model=cluster.model,
            concurrency=args.concurrency,
            num_requests=args.num_requests,
            seed=args.seed,
        )
        before = cluster.samples()
        result = asyncio.run(run_load(config, request_source(workload, builder, "tokens", args.seed)))
        after = cluster.samples()
    finally:
        cluster.stop()
    delta = {s: {k: v - before.get(s, {}).get(k, 0.0) for k, v in after[s].items()} for s in after}
    summary = summarize(result.records, result.duration_s)
    hits = sum(counter(delta, d, "pdserve_prefix_cache_hits_tokens_total") for d in ("d0", "d1"))
    queries = sum(counter(delta, d, "pdserve_prefix_cache_queries_tokens_total") for d in ("d0", "d1"))
    p_hits = counter(delta, "p0", "pdserve_prefix_cache_hits_tokens_total")
    p_queries = counter(delta, "p0", "pdserve_prefix_cache_queries_tokens_total")
    return {
        "variant": name,
        "completed": summary.completed,
        "ttft_p50_ms": summary.ttft.p50,
        "ttft_p99_ms": summary.ttft.p99,
        "req_per_s": summary.request_throughput,
        "d_hit_rate": hits / queries if queries else 0.0,
        "p_hit_rate": p_hits / p_queries if p_queries else 0.0,
        "kv_bytes_per_req": counter(delta, "p0", "pdserve_transfer_bytes_total") / max(1, summary.completed),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.compare.cache_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local model folder")
    p.add_argument("--workload", choices=["shared", "multi-turn"], default="shared")
    p.add_argument("--shared-prefix", type=int, default=1024, metavar="TOKENS")
    p.add_argument("--prefix-groups", type=int, default=4, metavar="G")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--prompt-len", default="32", help="question tokens (default %(default)s)")
    p.add_argument("--output-len", default="8")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--out", default="cache-sweep", help="configs, logs and results.json go here")
    args = p.parse_args(argv)
    question, output = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    if args.workload == "shared":
        workload = PrefixWorkload(
            "shared_prefix", question, output, shared_tokens=args.shared_prefix, groups=args.prefix_groups
        )
    else:
        workload = PrefixWorkload("multi_turn", question, output, turns=args.turns, conversations=args.conversations)
    builder = PromptBuilder(load_tokenizer(args.model))
    best = workload.best_hit_rate(args.num_requests, builder.num_special, args.seed)
    print(
        f"workload: {workload}; {args.num_requests} requests, concurrency {args.concurrency}; "
        f"best achievable hit rate {best:.1%}",
        flush=True,
    )
    rows = []
    for name in args.variants.split(","):
        rows.append(run_variant(name, args, workload, builder))
        r = rows[-1]
        print(
            f"{name:>15}: {r['completed']} ok, TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms, "
            f"{r['req_per_s']:.2f} req/s, D hit rate {r['d_hit_rate']:.1%} ({r['d_hit_rate'] / best:.0%} of "
            f"best), P hit rate {r['p_hit_rate']:.1%}, KV {r['kv_bytes_per_req'] / 1e6:.2f} MB/request",
            flush=True,
        )
    Path(args.out, "results.json").write_text(
        json.dumps({"workload": str(workload), "best_hit_rate": best, "variants": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
