"""Prefix caching side by side on 1P2D: caching off, on with round-robin, on with cache_aware.

    python3 -m bench.compare.cache_sweep --model DIR [--workload shared|multi-turn] [--out DIR]
    python3 -m bench.compare.cache_sweep --model tiny --variants on+cache_aware --router-replicas 1,2 --rounds 2

Each variant is a fresh cluster from configs/1p2d.yaml (or ``--layout 2p2d``; the model,
caching and the router policy changed), sent the same requests (bench/load/prefix_workload.py)
by the load client; afterwards each server's counters are read. Printed per variant:
TTFT p50/p99, request throughput, the decode servers' prefix hit rate (hits over
looked-up prompt tokens, ``pdserve_prefix_cache_*_tokens_total``) next to the best
the workload allows (``PrefixWorkload.best_hit_rate``), the prefill servers', and
the KV bytes the prefill servers sent per request (``pdserve_transfer_bytes_total``).

``--router-replicas 1,2`` runs each variant once per router count: N > 1 is ``router.replicas``
N behind the HAProxy front (deploy/front.py), each router with its own KV index; ``--rounds R``
repeats the whole set, the router counts in reverse order every other round, and a table per
variant pools the rounds: hit rates (tokens pooled), their ratio to the first router count, and
the mean TTFT p50. A script, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import free_port_pairs, launch
from bench.load.loadgen import LoadConfig, run_load
from bench.load.metrics import summarize
from bench.load.prefix_workload import PrefixWorkload
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.serve import request_source
from bench.load.workload import LengthDist
from engine.models import MODEL_CACHE, resolve_model

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "off": (False, "round_robin"),
    "on+round_robin": (True, "round_robin"),
    "on+cache_aware": (True, "cache_aware"),
}
LAYOUTS = ("1p2d", "2p2d")  # configs/<layout>.yaml
HITS, QUERIES = "pdserve_prefix_cache_hits_tokens_total", "pdserve_prefix_cache_queries_tokens_total"


def config_for(
    model: str,
    caching: bool,
    policy: str,
    local_prefill_threshold: int | None = None,
    replicas: int = 1,
    layout: str = "1p2d",
    kv_cache_bytes: int | None = None,
) -> dict:
    """configs/<layout>.yaml with ``model``, prefix caching on or off, ``policy``, one torch thread, free ports;
    ``local_prefill_threshold`` when given (the router's: shorter uncached parts are prefilled on D);
    ``replicas`` > 1: that many routers (``router.replicas``) behind the front on the router's port;
    ``kv_cache_bytes``: each server's KV cache (smaller than the workload's prefixes: routing decides the hits)."""
    data = yaml.safe_load((REPO / "configs" / f"{layout}.yaml").read_text())
    data["model"] = model
    data["engine"] = {**(data.get("engine") or {}), "prefix_caching": caching, "num_threads": 1}
    if kv_cache_bytes is not None:
        data["engine"]["kv_cache_bytes"] = kv_cache_bytes
    data["router"] = {**data["router"], "policy": policy}
    if local_prefill_threshold is not None:
        data["router"]["local_prefill_threshold"] = local_prefill_threshold
    instances = [*data["prefill"], *data["decode"]]
    extra = replicas if replicas > 1 else 0
    ports = free_port_pairs(1 + extra + len(instances))  # pairs for the replicas too: all ports distinct
    data["router"]["port"] = ports[0]
    if extra:
        data["router"]["replicas"] = replicas
        data["router"]["replica_ports"] = ports[1 : 1 + extra]
    for inst, port in zip(instances, ports[1 + extra :]):
        inst["port"], inst["kv_port"] = port, port + 1
    return data


def counter(samples: dict, server: str, name: str) -> float:
    """The sum of a counter's samples (every label set) on one server."""
    return sum(v for k, v in samples.get(server, {}).items() if k == name or k.startswith(name + "{"))


def run_plan(variants: list[str], replicas: list[int], rounds: int) -> list[tuple[int, str, int]]:
    """(round, variant, router count) in the order they run: each round every variant at every router
    count, the counts in reverse order every other round, so that on a machine whose load drifts
    neither count always runs first."""
    plan = []
    for r in range(rounds):
        order = replicas if r % 2 == 0 else replicas[::-1]
        plan += [(r, name, n) for name in variants for n in order]
    return plan


def run_label(name: str, replicas: int, round_: int, single: bool) -> str:
    """The run's folder under ``--out``: the variant's name alone when it runs once with one router."""
    return name if single else f"{name}-{replicas}r-round{round_}"


def role_tokens(delta: dict, servers: list[str], name: str) -> float:
    """A counter's increase summed over ``servers``."""
    return sum(counter(delta, s, name) for s in servers)


def replica_table(rows: list[dict]) -> list[dict]:
    """Per variant and router count, over its rounds: hit rates from the pooled tokens, each rate's ratio
    to the same variant's first router count (in ``rows``' order), the mean TTFT p50, the rounds."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["replicas"]), []).append(r)
    first: dict[str, tuple[float, float]] = {}
    table = []
    for (variant, replicas), runs in groups.items():
        d = _pooled(runs, "d_hits", "d_queries")
        p = _pooled(runs, "p_hits", "p_queries")
        base_d, base_p = first.setdefault(variant, (d, p))
        table.append(
            {
                "variant": variant,
                "replicas": replicas,
                "rounds": len(runs),
                "d_hit_rate": d,
                "d_ratio": d / base_d if base_d else float("nan"),
                "p_hit_rate": p,
                "p_ratio": p / base_p if base_p else float("nan"),
                "ttft_p50_ms": sum(r["ttft_p50_ms"] for r in runs) / len(runs),
                "ttft_p50_each_ms": [r["ttft_p50_ms"] for r in runs],
            }
        )
    return table


def routed_requests(routers: list[dict]) -> dict[str, float]:
    """Requests each router finished (``pdserve_router_requests_total``, every label), by its name: how the
    front spread the load."""
    out = {}
    with httpx.Client(timeout=5.0) as client:
        for proc in routers:
            text = client.get(proc["url"] + "/metrics").text
            out[proc["name"]] = sum(
                float(line.rpartition(" ")[2])
                for line in text.splitlines()
                if line.startswith("pdserve_router_requests_total")
            )
    return out


def _pooled(runs: list[dict], hits: str, queries: str) -> float:
    total = sum(r[queries] for r in runs)
    return sum(r[hits] for r in runs) / total if total else 0.0


def run_variant(
    name: str, args, workload: PrefixWorkload, builder: PromptBuilder, replicas: int = 1, label: str | None = None
) -> dict:
    caching, policy = VARIANTS[name]
    out = Path(args.out) / (label or name)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.layout}.yaml"
    layout = config_for(
        args.model, caching, policy, replicas=replicas, layout=args.layout, kv_cache_bytes=args.kv_cache_bytes
    )
    path.write_text(yaml.safe_dump(layout, sort_keys=False))
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
        routed = routed_requests(cluster.processes("router"))
    finally:
        cluster.stop()
    delta = {s: {k: v - before.get(s, {}).get(k, 0.0) for k, v in after[s].items()} for s in after}
    summary = summarize(result.records, result.duration_s)
    decode = [i["name"] for i in layout["decode"]]
    prefill = [i["name"] for i in layout["prefill"]]
    hits, queries = role_tokens(delta, decode, HITS), role_tokens(delta, decode, QUERIES)
    p_hits, p_queries = role_tokens(delta, prefill, HITS), role_tokens(delta, prefill, QUERIES)
    return {
        "variant": name,
        "replicas": replicas,
        "completed": summary.completed,
        "failed": summary.failed,
        "routed": routed,
        "ttft_p50_ms": summary.ttft.p50,
        "ttft_p99_ms": summary.ttft.p99,
        "req_per_s": summary.request_throughput,
        "d_hit_rate": hits / queries if queries else 0.0,
        "p_hit_rate": p_hits / p_queries if p_queries else 0.0,
        "d_hits": hits,
        "d_queries": queries,
        "p_hits": p_hits,
        "p_queries": p_queries,
        "kv_bytes_per_req": role_tokens(delta, prefill, "pdserve_transfer_bytes_total") / max(1, summary.completed),
    }


def replica_counts(text: str) -> list[int]:
    """``1,2`` -> [1, 2]: distinct router counts, each at least 1, in the order given."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"router counts {text!r}: give integers, e.g. 1,2") from None
    if any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"router counts {text!r}: each at least 1, none twice")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.compare.cache_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local model folder or a built-in model (e.g. tiny)")
    p.add_argument("--layout", choices=LAYOUTS, default="1p2d", help="configs/LAYOUT.yaml (default %(default)s)")
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
    p.add_argument(
        "--router-replicas",
        type=replica_counts,
        default=[1],
        metavar="N[,N...]",
        help="run each variant with each of these router counts (N > 1: router.replicas N behind the HAProxy "
        "front); the first is the base of the ratios (default 1)",
    )
    p.add_argument("--rounds", type=int, default=1, help="repeat every run, router counts reversed every other round")
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="each server's KV cache (default: the engine's); smaller than the prefixes, routing decides the hits",
    )
    p.add_argument("--out", default="cache-sweep", help="configs, logs and results.json go here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    question, output = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    if args.workload == "shared":
        workload = PrefixWorkload(
            "shared_prefix", question, output, shared_tokens=args.shared_prefix, groups=args.prefix_groups
        )
    else:
        workload = PrefixWorkload("multi_turn", question, output, turns=args.turns, conversations=args.conversations)
    builder = PromptBuilder(load_tokenizer(resolve_model(args.model, MODEL_CACHE)))
    best = workload.best_hit_rate(args.num_requests, builder.num_special, args.seed)
    print(
        f"workload: {workload}; {args.num_requests} requests, concurrency {args.concurrency}, {args.layout}; "
        f"best achievable hit rate {best:.1%}",
        flush=True,
    )
    plan = run_plan(args.variants.split(","), args.router_replicas, args.rounds)
    single = len(args.router_replicas) == 1 and args.rounds == 1
    rows = []
    for round_, name, replicas in plan:
        rows.append(run_variant(name, args, workload, builder, replicas, run_label(name, replicas, round_, single)))
        r = rows[-1]
        tag = name if single else f"{name} x{replicas} #{round_}"
        print(
            f"{tag:>15}: {r['completed']} ok, TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms, "
            f"{r['req_per_s']:.2f} req/s, D hit rate {r['d_hit_rate']:.1%} ({r['d_hit_rate'] / best:.0%} of "
            f"best), P hit rate {r['p_hit_rate']:.1%}, KV {r['kv_bytes_per_req'] / 1e6:.2f} MB/request, "
            f"per router {' '.join(f'{k} {v:.0f}' for k, v in r['routed'].items())}",
            flush=True,
        )
    result: dict = {"workload": str(workload), "best_hit_rate": best, "variants": rows}
    if not single:
        result["by_replicas"] = table = replica_table(rows)
        print(format_replica_table(table))
    Path(args.out, "results.json").write_text(json.dumps(result, indent=1))
    return 0


def format_replica_table(table: list[dict]) -> str:
    """The pooled rows as a Markdown table (the ratios are to the variant's first router count)."""
    lines = [
        "| variant | routers | rounds | D hit rate | D ratio | P hit rate | P ratio | TTFT p50 (each round) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        each = " / ".join(f"{v:.0f}" for v in t["ttft_p50_each_ms"])
        lines.append(
            f"| {t['variant']} | {t['replicas']} | {t['rounds']} | {t['d_hit_rate']:.1%} | {t['d_ratio']:.3f} | "
            f"{t['p_hit_rate']:.1%} | {t['p_ratio']:.3f} | {t['ttft_p50_ms']:.0f} ms ({each}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
