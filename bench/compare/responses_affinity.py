"""Multi-turn chats on 1P2D through ``/v1/responses``: the router's decode affinity against no hint.

    python3 -m bench.compare.responses_affinity [--model tiny|DIR] [--conversations 3] [--turns 4]
        [--concurrency N] [--prompt-len 64] [--output-len 16] [--rounds 2] [--layout 1p2d|2p2d] [--out DIR]

Every variant runs on a fresh cluster from configs/1p2d.yaml (or ``--layout``'s; the model changed,
prefix caching on, router policy round_robin, one torch thread per server) and is sent the same chats:
``--conversations`` side by side, ``--turns`` turns each, a new question of ``--prompt-len`` tokens a
turn, answers of up
to ``--output-len`` tokens at temperature 0 (no ``ignore_eos``: the Responses API has none, so no
variant sends it), turn t of a chat sent once turn t-1 is answered (bench/load/loadgen.py, history),
at most ``--concurrency`` requests in flight (default: one per chat). With ``--turns 1`` every prompt is
unshared, a new question alone: ``--variants chat,chat-pull`` then measures what the pull costs
traffic that has nothing to read.

* ``affinity``: ``/v1/responses``, each turn only its new question with the previous turn's
  ``previous_response_id``; the router tries the decode server that answered the previous turn first
  (its prefix cache holds the conversation), round robin after it.
* ``full-input``: ``/v1/responses`` without ``previous_response_id``: each turn sends the whole
  conversation as input items (earlier questions and the server's own answers), so the router has no
  hint and round robin alone picks the decode server. The router has no switch that turns the hint off;
  this is the same endpoint and the same prompt without it.
* ``chat``: ``/v1/chat/completions`` with the whole conversation as messages, round robin: how a
  stateless client continues a chat today.
* ``affinity-tiers``, ``chat-tiers``: every server with a host-memory KV tier of ``--tier-bytes``.
* ``affinity-tiers-pull``, ``chat-tiers-pull``: the tiers and the pull (below) both on, against
  ``affinity`` or ``chat`` with both off: KV that outlives one server's cache, all of it.
* ``affinity-pull``, ``chat-pull``: as ``affinity`` and ``chat`` with ``transfer.pull_prefix`` on (the
  default; the variants without ``-pull`` turn it off): a
  prefill server reads the part of the prompt its own cache lacks and the decode server's reservation
  holds back from that decode server instead of computing it (decode-to-prefill reuse,
  docs/kv-tiers.md); ``pulled tok/req`` is what they read (``pdserve_kv_prefix_pulled_tokens_total``),
  results.json's ``reads`` and ``reads_skipped`` the reads used and those not asked for because computing
  was estimated faster (prefill_server/pull_rule.py, ``transfer.pull_prefix_margin``).

The three send token-identical prompts when the answers are the same (greedy, the same model). Per
turn it reports TTFT p50/p99 and, from each answer's usage, input tokens, cached tokens (found in the
decode server's prefix cache) and the share of input tokens not cached there (input - cached: what the
prefill server had to supply, compute or find in its own cache, and send). Per variant it reports the
prompt tokens the engines computed (``pdserve_engine_tokens_total{kind="prompt"}`` on every server: the
prefill server keeps a prefix cache of its own) and the KV bytes the prefill server sent
(``pdserve_transfer_bytes_total``). Each cluster first runs the same chats with other words
(``--warmup-runs``), unmeasured: a fresh cluster's first requests of each kind pay one-time costs.
Variants alternate within each of ``--rounds`` rounds (ABC, then CBA, ...), so slow drift of a shared
machine lands on all of them; the rounds are pooled, and the TTFT p50 of each round is listed so the
spread is on the page. Writes ``results.json`` and ``report.md`` to ``--out``. A script, not a test:
numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.compare.cache_sweep import config_for, counter
from bench.load.cluster import launch
from bench.load.loadgen import CHAT, RESPONSES, LoadConfig, run_load
from bench.load.metrics import RequestRecord, TurnStats, per_turn, summarize
from bench.load.prefix_workload import PrefixWorkload
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.serve import request_source
from bench.load.workload import LengthDist
from engine.models import MODEL_CACHE, resolve_model

SERVERS = ("p0", "d0", "d1")


@dataclass(frozen=True)
class Variant:
    endpoint: str
    history: str  # LoadConfig.history
    what: str
    tiers: bool = False  # every server with a host-memory KV tier of --tier-bytes (engine/tiers/)
    pull: bool = False  # transfer.pull_prefix: prefill servers read the decode server's cached prefix


VARIANTS = {
    "affinity": Variant(RESPONSES, "previous-response", "/v1/responses, previous_response_id: previous decode first"),
    "full-input": Variant(RESPONSES, "messages", "/v1/responses, whole conversation as input, no hint"),
    "chat": Variant(CHAT, "messages", "/v1/chat/completions, whole conversation as messages"),
    "affinity-tiers": Variant(
        RESPONSES, "previous-response", "as affinity, every server with a host KV tier", tiers=True
    ),
    "chat-tiers": Variant(CHAT, "messages", "as chat, every server with a host KV tier", tiers=True),
    "affinity-pull": Variant(
        RESPONSES, "previous-response", "as affinity, decode-to-prefill reuse on (pull_prefix)", pull=True
    ),
    "chat-pull": Variant(CHAT, "messages", "as chat, decode-to-prefill reuse on (pull_prefix)", pull=True),
    "affinity-tiers-pull": Variant(
        RESPONSES, "previous-response", "as affinity, host KV tiers and the pull both on", tiers=True, pull=True
    ),
    "chat-tiers-pull": Variant(CHAT, "messages", "as chat, host KV tiers and the pull both on", tiers=True, pull=True),
}
DEFAULT_VARIANTS = ("affinity", "full-input", "chat")


def engine_counters(before: dict, after: dict, servers: tuple[str, ...] = SERVERS) -> dict[str, float]:
    """What the run added: prompt tokens computed per server, prefix-cache hit tokens per server, and the
    KV bytes the prefill servers sent and the prompt tokens they read back from decode servers."""
    delta = {s: {k: v - before.get(s, {}).get(k, 0.0) for k, v in after.get(s, {}).items()} for s in after}
    out = {}
    for s in servers:
        out[f"{s}_prompt_computed"] = sum(
            v for k, v in delta.get(s, {}).items() if k.startswith("pdserve_engine_tokens_total{") and 'prompt"' in k
        )
        out[f"{s}_prefix_hits"] = counter(delta, s, "pdserve_prefix_cache_hits_tokens_total")
    prefill = [s for s in servers if s.startswith("p")]
    out["kv_bytes"] = sum(counter(delta, s, "pdserve_transfer_bytes_total") for s in prefill)
    out["pulled_tokens"] = sum(counter(delta, s, "pdserve_kv_prefix_pulled_tokens_total") for s in prefill)
    out["pulls"] = sum(counter(delta, s, "pdserve_kv_prefix_pull_seconds_count") for s in prefill)
    out["pull_seconds"] = sum(counter(delta, s, "pdserve_kv_prefix_pull_seconds_sum") for s in prefill)
    skipped = 'pdserve_kv_prefix_pulls_total{outcome="not_worth_it"}'  # computing was estimated faster
    out["pulls_skipped"] = sum(counter(delta, s, skipped) for s in prefill)
    return out


def servers_of(counters: dict[str, float]) -> list[str]:
    """The servers a run's counters name, in their order."""
    return [k.removesuffix("_prompt_computed") for k in counters if k.endswith("_prompt_computed")]


def run_variant(name: str, rnd: int, args, workload: PrefixWorkload, builder: PromptBuilder) -> dict:
    """One fresh cluster, the whole workload; its records and counters."""
    v = VARIANTS[name]
    out = Path(args.out) / f"round{rnd}" / name
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.layout}.yaml"
    data = config_for(args.model, True, "round_robin", args.local_prefill_threshold, layout=args.layout)
    data["transfer"] = {**(data.get("transfer") or {}), "pull_prefix": v.pull}
    servers = tuple(i["name"] for i in (*data["prefill"], *data["decode"]))
    if args.kv_cache_bytes is not None:
        data["engine"]["kv_cache_bytes"] = args.kv_cache_bytes
    if v.tiers:
        data["engine"]["kv_tiers"] = {"host_bytes": args.tier_bytes}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cluster = launch(path, out / "run", sorted(os.sched_getaffinity(0)))
    try:
        config = LoadConfig(
            url=cluster.url,
            model=cluster.model,
            endpoint=v.endpoint,
            concurrency=args.concurrency or args.conversations,
            num_requests=args.conversations * args.turns,
            temperature=0.0,
            ignore_eos=False,
            seed=args.seed,
            history=v.history,
        )
        source = request_source(workload, builder, "text", args.seed, chained=True)
        for i in range(args.warmup_runs):  # the same chats with other words, left out of the counters
            asyncio.run(run_load(config, request_source(workload, builder, "text", args.seed + 1 + i, chained=True)))
        before = cluster.samples()
        result = asyncio.run(run_load(config, source))
        after = cluster.samples()
    finally:
        killed = cluster.stop()
    if killed:
        print(f"note: {name} round {rnd}: had to kill pids {killed}", file=sys.stderr)
    return {
        "variant": name,
        "round": rnd,
        "records": result.records,
        "duration_s": result.duration_s,
        "counters": engine_counters(before, after, servers),
        "pull_estimates": pull_estimates(after, servers),
    }


def pull_estimates(after: dict, servers: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each prefill server's read-versus-compute estimates at the end of a run (prefill_server/pull_rule.py):
    read MB/s beyond a read's fixed 5 ms, and prompt tokens/s of its engine."""
    return {
        s: {
            "read_mb_per_s": after.get(s, {}).get("pdserve_kv_prefix_read_bytes_per_second", 0.0) / 1e6,
            "compute_tokens_per_s": after.get(s, {}).get("pdserve_kv_prefix_compute_tokens_per_second", 0.0),
        }
        for s in servers
        if s.startswith("p")
    }


def pooled(runs: list[dict]) -> dict:
    """One variant's rounds together: per turn stats, TTFT over all turns, counters per request."""
    records: list[RequestRecord] = [r for run in runs for r in run["records"]]
    ok = [r for r in records if r.ok]
    summary = summarize(records, sum(run["duration_s"] for run in runs))
    totals = {k: sum(run["counters"].get(k, 0.0) for run in runs) for k in runs[0]["counters"]}
    servers = servers_of(runs[0]["counters"])
    n = max(1, len(ok))
    later = [r for r in records if r.turn is not None and r.turn >= 2]
    return {
        "completed": summary.completed,
        "failed": summary.failed,
        "errors": summary.errors,
        "ttft_p50_ms": summary.ttft.p50,
        "ttft_p99_ms": summary.ttft.p99,
        "tpot_p50_ms": summary.tpot.p50,
        "e2e_p50_ms": summary.e2e.p50,
        "round_ttft_p50_ms": [summarize(run["records"]).ttft.p50 for run in runs],
        "output_tokens_per_req": sum(r.output_tokens for r in ok) / n,
        "input_tokens_per_req": sum(r.server_prompt_tokens or 0 for r in ok) / n,
        "cached_tokens_per_req": sum(r.cached_tokens or 0 for r in ok) / n,
        "ttft_p50_from_turn3_ms": summarize(later).ttft.p50 if later else None,
        "prompt_computed_per_req": {s: totals[f"{s}_prompt_computed"] / n for s in servers},
        "prefix_hits_per_req": {s: totals[f"{s}_prefix_hits"] / n for s in servers},
        "kv_mb_per_req": totals["kv_bytes"] / n / 1e6,
        "pulled_tokens_per_req": totals.get("pulled_tokens", 0.0) / n,
        "pull_ms_per_read": 1e3 * totals.get("pull_seconds", 0.0) / max(1.0, totals.get("pulls", 0.0)),
        "reads": totals.get("pulls", 0.0),  # reads asked for and used
        "reads_skipped": totals.get("pulls_skipped", 0.0),  # not asked for: not worth it (pull_rule.py)
        "pull_estimates_per_round": [run.get("pull_estimates", {}) for run in runs],
        "per_turn": [t.to_json() for t in per_turn(records)],
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _per_req(t: TurnStats, n: int) -> str:
    return "-" if not t.reported else f"{n / t.reported:.1f}"


def report(results: dict, command: str) -> str:
    """The markdown: the workload, per turn per variant, ratios against the first variant, totals."""
    names = list(results["variants"])
    base = names[0]
    lines = [
        f"Workload: {results['workload']}; {results['rounds']} round(s), a fresh "
        f"{results.get('layout', '1p2d').upper()} cluster per variant "
        f"and round (prefix caching on, round_robin, local_prefill_threshold "
        f"{results.get('local_prefill_threshold') or 0}); model {results['model']}.",
        "",
        f"    {command}",
        "",
    ]
    for name in names:
        lines.append(f"- {name}: {VARIANTS[name].what}")
    lines += [
        "",
        "The router has no switch that turns the affinity off: full-input and chat send the same",
        "conversation without previous_response_id, so the router has no hint and round robin decides.",
        "",
        "| turn | variant | TTFT p50 / p99 ms | input tok/req | cached tok/req | not cached on D |",
        "|---|---|---|---|---|---|",
    ]
    turns = {name: [TurnStats.from_json(t) for t in results["variants"][name]["per_turn"]] for name in names}
    for i, ref in enumerate(turns[base]):
        for name in names:
            t = turns[name][i] if i < len(turns[name]) else None
            if t is None:
                continue
            share = "-" if t.computed_share is None else f"{100 * t.computed_share:.0f} %"
            lines.append(
                f"| {ref.turn} | {name} | {_ms(t.ttft.p50)} / {_ms(t.ttft.p99)} | {_per_req(t, t.input_tokens)} | "
                f"{_per_req(t, t.cached_tokens)} | {share} |"
            )
    others = names[1:]
    if others:
        lines += [
            "",
            "TTFT against " + base + " (p50 ratio, p99 ratio; above 1: " + base + " is faster):",
            "",
            "| turn | " + " | ".join(others) + " |",
            "|---|" + "---|" * len(others),
        ]
        for i, ref in enumerate(turns[base]):
            cells = []
            for name in others:
                t = turns[name][i] if i < len(turns[name]) else None
                cells.append(
                    "-" if t is None else f"{_ratio(t.ttft.p50, ref.ttft.p50)}, {_ratio(t.ttft.p99, ref.ttft.p99)}"
                )
            lines.append(f"| {ref.turn} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| variant | ok / failed | TTFT p50 / p99 ms (all turns) | TTFT p50 per round ms | output tok/req "
        f"| prompt tokens computed/req {', '.join(results['variants'][base]['prompt_computed_per_req'])} "
        "| KV sent/req | pulled tok/req (ms/read) | TTFT p50 from turn 3 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        v = results["variants"][name]
        computed = ", ".join(f"{c:.0f}" for c in v["prompt_computed_per_req"].values())
        rounds = ", ".join(_ms(x) for x in v["round_ttft_p50_ms"])
        lines.append(
            f"| {name} | {v['completed']} / {v['failed']} | {_ms(v['ttft_p50_ms'])} / {_ms(v['ttft_p99_ms'])} | "
            f"{rounds} | {v['output_tokens_per_req']:.1f} | {computed} | {v['kv_mb_per_req']:.3f} MB | "
            f"{v.get('pulled_tokens_per_req', 0.0):.1f} ({v.get('pull_ms_per_read', 0.0):.1f}) | "
            f"{_ms(v.get('ttft_p50_from_turn3_ms'))} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m bench.compare.responses_affinity",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[2:]),
    )
    p.add_argument("--model", default="tiny", help="a local model folder, or a built-in one (default %(default)s)")
    p.add_argument("--conversations", type=int, default=3, help="chats side by side (default %(default)s)")
    p.add_argument("--turns", type=int, default=4, help="turns per chat (default %(default)s)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight at once (default: --conversations); with --turns 1, short unshared prompts",
    )
    p.add_argument("--prompt-len", default="64", help="new question tokens a turn (default %(default)s)")
    p.add_argument("--output-len", default="16", help="max_output_tokens (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="fresh clusters per variant (default %(default)s)")
    p.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        metavar="N",
        help="unmeasured runs of the same chats with other words on each cluster first (default %(default)s)",
    )
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        metavar="TOKENS",
        help="the router's: a prompt whose part the chosen decode server does not cache is shorter than this "
        "is prefilled there, not on P (default: the config's, 0: always P)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="each server's KV cache (default: the config's)")
    p.add_argument(
        "--tier-bytes", type=int, default=1 << 28, help="the host KV tier of the *-tiers variants (default 256 MiB)"
    )
    p.add_argument(
        "--layout", default="1p2d", choices=("1p2d", "2p2d"), help="configs/<layout>.yaml (default %(default)s)"
    )
    p.add_argument("--out", default="responses-affinity", help="configs, logs, results.json and report.md go here")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        p.error(f"unknown variants {unknown}: pick from {', '.join(VARIANTS)}")
    if args.rounds < 1 or args.conversations < 1 or args.turns < 1 or (args.concurrency or 1) < 1:
        p.error("--rounds, --conversations, --turns and --concurrency must be >= 1")
    question, output = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    workload = PrefixWorkload("multi_turn", question, output, turns=args.turns, conversations=args.conversations)
    builder = PromptBuilder(load_tokenizer(resolve_model(args.model, MODEL_CACHE)))
    command = "python3 -m bench.compare.responses_affinity " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"workload: {workload}; variants {', '.join(names)}; {args.rounds} round(s)", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            run = run_variant(name, rnd, args, workload, builder)
            runs[name].append(run)
            s = summarize(run["records"])
            print(
                f"round {rnd} {name:>10}: {s.completed} ok, {s.failed} failed, TTFT p50 {_ms(s.ttft.p50)} ms "
                f"p99 {_ms(s.ttft.p99)} ms",
                flush=True,
            )
    results = {
        "command": command,
        "model": args.model,
        "layout": args.layout,
        "local_prefill_threshold": args.local_prefill_threshold,
        "workload": str(workload),
        "rounds": args.rounds,
        "variants": {n: pooled(runs[n]) for n in names},
        "requests": {
            n: [r.to_json() | {"round": run["round"]} for run in runs[n] for r in run["records"]] for n in names
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results, command)
    (out / "report.md").write_text(text)
    print(text)
    print(f"results: {out / 'results.json'}, {out / 'report.md'}")
    return 0 if all(results["variants"][n]["completed"] for n in names) else 1


if __name__ == "__main__":
    raise SystemExit(main())
