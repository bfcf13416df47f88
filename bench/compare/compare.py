"""``pdserve bench compare``: the colocated baseline vs an xPyD layout, measured.

One run, one machine, the same cores for both sides:

1. profile the model (or load ``--profile``) for the planner's predictions;
2. write a cluster config with free ports for each layout (colocated with
   every core in one engine; the xPyD layout with the cores split between
   its instances; for the idle-2k scenario also the xPyD layout with P given
   every core, so its TTFT is compared at equal prefill compute) and
   ``pdserve launch`` them all, pinned to ``--cpus``; an idle cluster only
   wakes for its health checks;
3. cut every scenario into rounds and send each round to every layout in
   turn, in ABBA order (A B, then B A): drift on a shared machine falls on
   both sides alike, instead of on whichever ran second; each layout's
   rounds are pooled, and per-round ratios show the spread;
4. stop every cluster by pid; simulate each measured run (same lengths, same send times) with the
   planner, calibrated per layout by a few tiny probe requests (the
   server's fixed per-step and per-request costs, which the engine profile
   cannot see), and write ``report.md``, ``results.json`` and plots.

This module is the command: its arguments and the run from end to end.
Launching the layouts, measuring them and simulating them calibrated is
``bench/compare/compare_run.py``; the ``--sweep`` rate ladder is
``bench/compare/compare_sweep.py``; the report is ``bench/compare/compare_report.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from bench.compare.compare_report import write_report
from bench.compare.compare_run import Run, Side, run_scenario, start_side, stop_side
from bench.compare.compare_sweep import DEFAULT_SCENARIOS, QUICK, sweep_all, write_sweep
from bench.compare.scenarios import EngineKnobs, Scenario, parse_rates, select
from bench.load.cluster import cpu_list
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.plan.costmodel import Overheads
from bench.plan.plan import MIB, Candidate, EngineSettings, build_layout
from bench.plan.profile import Profile, ProfileGrid, profile_engine
from bench.plan.simulate import Layout
from engine.config import EngineConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", metavar="DIR", help="model folder (default: build the ~90M benchmark model, answering in text)"
    )
    p.add_argument("--layout", default="1p1d", help="the disaggregated layout, xPyD (default 1p1d)")
    p.add_argument("--cpus", metavar="LIST", help="cores for both sides, e.g. 0,1 (default: all allowed)")
    p.add_argument("--scenarios", metavar="LIST", help="prefill-heavy,short,idle-2k (default: all)")
    p.add_argument("--rate", action="append", metavar="NAME=R", help="override a scenario's arrival rate")
    p.add_argument("--scale", type=float, default=1.0, help="multiply request counts (default 1)")
    p.add_argument("--profile", metavar="FILE", help="saved profile for predictions (default: profile now)")
    p.add_argument("--quick-profile", action="store_true", help="profile with the small grid")
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=EngineConfig.kv_cache_bytes // MIB,
        help="KV cache per instance (default %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        help="tokens one engine step computes at most (default %(default)s)",
    )
    p.add_argument("--out", default="runs/compare", help="report folder (default runs/compare)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds for a cluster to come up")
    sw = p.add_argument_group("sweep (bench/compare/compare_sweep.py)")
    sw.add_argument(
        "--sweep",
        action="store_true",
        help="find each layout's highest rate meeting the SLO (default scenarios: short,prefill-heavy)",
    )
    sw.add_argument(
        "--attainment",
        type=float,
        default=90.0,
        metavar="PCT",
        help="share of requests that must meet both SLOs (default 90)",
    )
    sw.add_argument(
        "--sweep-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests per round at each rate (default 8; 4 with --quick)",
    )
    sw.add_argument(
        "--sweep-rates",
        metavar="LIST",
        help="the rates to climb, e.g. 0.1,0.2,0.4 (default: a ladder per scenario, compare_sweep.LADDERS)",
    )
    sw.add_argument(
        "--time-budget",
        type=float,
        default=1500.0,
        metavar="S",
        help="seconds for the whole sweep, launch and profile included (default 1500)",
    )
    sw.add_argument(
        "--quick",
        action="store_true",
        help="CI smoke: a tiny model, short requests, two rates, quick profile (implies --sweep)",
    )


def benchmark_model(cache: Path) -> str:
    """The lead's ~90M benchmark model (engine_bench.BENCH_SPEC), made to answer in text.

    BENCH_SPEC has a 16384-id vocabulary but its tokenizer knows ~620 tokens,
    so greedy decoding mostly picks ids with no text and the router streams
    nothing to time. Zeroing the (tied) embedding rows past the tokenizer
    makes those logits exactly 0, below the largest real one: same shapes,
    same compute per step, answers that decode to text.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from bench.micro.engine_bench import BENCH_SPEC
    from engine.make_model import make_tiny

    folder = cache / "bench90m-text"
    if (folder / "bench_text_model.json").is_file():
        return str(folder)
    tmp = cache / "bench90m-text.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny(tmp, BENCH_SPEC)
    known = len(AutoTokenizer.from_pretrained(str(tmp), local_files_only=True))
    weights = load_file(str(tmp / "model.safetensors"))
    table = weights["model.embed_tokens.weight"]
    with torch.no_grad():
        table[known:] = 0
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "bench_text_model.json").write_text(
        json.dumps({"spec": "engine_bench.BENCH_SPEC", "zeroed_embedding_rows_from": known}) + "\n"
    )
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return str(folder)


def run_sweep(args: argparse.Namespace, scenarios: list[Scenario], sides: list[Side], ctx: dict, started: float) -> int:
    args.sweep_requests = args.sweep_requests or (4 if args.quick else 8)
    with ExitStack() as stack:
        for side in sides:
            stack.callback(stop_side, side)
            start_side(side, ctx)
        sweeps = sweep_all(scenarios, sides, ctx, args, args.quick)
    meta = {
        "model": ctx["model"],
        "cpus": ctx["cpus"],
        "wall_s": time.time() - started,
        "command": "pdserve " + " ".join(sys.argv[1:]),
        "profile": ctx["profile_path"],
        "settings": dataclasses.asdict(ctx["settings"]),
        "layouts": {s.name: dataclasses.asdict(s.cand) for s in sides},
        "calibration": sweeps[0].calibration,
    }  # the launch calibration: the first scenario used it
    report = write_sweep(ctx["out"], sweeps, [s.name for s in sides], meta, args.attainment / 100)
    print(report.read_text())
    print(f"report: {report}")
    return 0


def tiny_model(cache: Path) -> str:
    """The engine's tiny test model (``engine.make_model.TinySpec``), made once under ``cache``."""
    from engine.make_model import TinySpec, make_tiny

    folder = cache / "tiny-qwen3"
    if not (folder / "config.json").is_file():
        make_tiny(folder, TinySpec())
    return str(folder)


def run(args: argparse.Namespace) -> int:
    started = time.time()
    cpus = cpu_list(args.cpus)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweeping = args.sweep or args.quick
    if args.quick:
        scenarios = [QUICK]
    elif sweeping:
        scenarios = select(args.scenarios or DEFAULT_SCENARIOS, args.scale, parse_rates(args.rate))
        if any(s.idle for s in scenarios):
            raise ValueError("--sweep runs open-loop scenarios only; leave out idle-2k")
    else:
        scenarios = select(args.scenarios, args.scale, parse_rates(args.rate))
    cand = Candidate.parse(args.layout, len(cpus), per_device=False)
    if cand.num_prefill == 0:
        raise ValueError(f"--layout {args.layout!r} is colocated; give an xPyD layout such as 1p1d")
    baseline = Candidate(0, 1, len(cpus))
    model = args.model or (
        tiny_model(Path("runs") / "models") if args.quick else benchmark_model(Path("runs") / "models")
    )
    knobs = EngineKnobs(
        kv_cache_bytes=args.kv_cache_mib * MIB,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=not sweeping,
    )
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        grid = ProfileGrid.quick() if args.quick_profile or args.quick else ProfileGrid()
        profile = profile_engine(model, sorted({1, cand.threads, len(cpus)}), grid)
        profile.save(out / "profile.json")
    profile_path = str(args.profile or out / "profile.json")
    settings = EngineSettings(knobs.block_size, knobs.kv_cache_bytes, knobs.max_num_seqs, knobs.max_num_batched_tokens)

    def layout_for(c: Candidate, prefill_threads: int | None) -> Layout:
        layout = build_layout(c, profile, settings, Overheads())
        if prefill_threads is not None:
            layout = replace(layout, prefill=(settings.spec(profile, prefill_threads),) * c.num_prefill)
        return layout

    ctx = {
        "out": out,
        "model": model,
        "knobs": knobs,
        "cpus": cpus,
        "launch_timeout": args.launch_timeout,
        "settings": settings,
        "profile_path": profile_path,
        "builder": PromptBuilder(load_tokenizer(model)),
        "seed": args.seed,
        "layout_for": layout_for,
        "deadline": started + args.time_budget,
    }
    if sweeping:
        return run_sweep(args, scenarios, [Side("colocated", baseline), Side(cand.name, cand)], ctx, started)
    sides = [Side("colocated", baseline), Side(cand.name, cand)]
    if any(s.idle for s in scenarios) and cand.threads < len(cpus):
        sides.append(Side(f"{cand.name}-P{len(cpus)}t", cand, prefill_threads=len(cpus), idle_only=True))
    runs: list[Run] = []
    with ExitStack() as stack:
        for side in sides:
            stack.callback(stop_side, side)
            start_side(side, ctx)
        for scenario in scenarios:
            runs += run_scenario(scenario, [s for s in sides if scenario.idle or not s.idle_only], ctx)
    transfer = profile.transfer_cost()
    meta = {
        "model": model,
        "cpus": cpus,
        "transfer": {
            "bandwidth": transfer.bandwidth,
            "source": profile.transfer_source,
            "tail_2k_s": {
                t: transfer.arrival(2048, 0.0, c) - c
                for t in (cand.threads, len(cpus))
                for c in [profile.cost(t).prefill_time(2048)]
            },
        },
        "layout": cand.name,
        "threads": {"colocated": len(cpus), cand.name: cand.threads},
        "profile": {k: v for k, v in profile.to_json().items() if k != "samples"},
        "wall_s": time.time() - started,
        "command": "pdserve " + " ".join(sys.argv[1:]),
    }
    report = write_report(out, runs, meta)
    (out / "results.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "runs": [
                    {
                        "layout": r.layout,
                        "scenario": r.scenario.name,
                        "measured": r.measured.to_json(),
                        "predicted": r.predicted.to_json() if r.predicted else None,
                        "transfer": r.transfer,
                        "loadavg": r.loadavg,
                        "calibration": r.calibration,
                        "engines": r.engines,
                        "rounds": [x.to_json() for x in r.rounds],
                        "requests": [x.to_json() for x in r.records],
                    }
                    for r in runs
                ],
            },
            indent=1,
        )
        + "\n"
    )
    print(report.read_text())
    print(f"report: {report}")
    return 0
