"""``pdserve plan``: recommend colocated or xPyD, and x and y, for a workload.

Profiles the engine (or loads a saved profile), builds every candidate
layout that fits the machine, simulates each one on the same arrivals and
recommends the one with the highest goodput; near ties (within 2%) go to
fewer instances, then to the lower p99 TPOT.

On CPU an instance gets ``cores // instances`` torch threads, so colocated
uses every core in one engine while 1P1D splits them: that trade (faster
steps vs no interference) is exactly what the planner weighs. With
``--gpus N`` each instance is one device and the profile's one cost applies.

With ``--tp 1,2`` the candidates also split instances over tensor-parallel
ranks (one core share or one GPU each): ``1P1D tp2/1`` is a prefill
instance on 2 ranks and a decode instance on 1, next to ``2P1D`` on the
same units. A split instance's step costs its compute over N plus two
all-reduces a layer (bench/plan/costmodel.py ``split_step_cost``), and it
holds N times the KV blocks. pdserve runs tensor parallelism on colocated
instances only for now: layouts with a split prefill or decode instance
are predictions of what that would give.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from bench.load.metrics import Summary, summarize
from bench.load.report import stats_row
from bench.load.workload import Workload, poisson_arrivals
from bench.plan.costmodel import Overheads
from bench.plan.profile import Profile, ProfileGrid, profile_engine
from bench.plan.sim_instances import InstanceSpec
from bench.plan.simulate import Layout, simulate
from engine.config import DTYPES, EngineConfig
from engine.models import BUILTIN_MODELS, MODEL_CACHE, resolve_model

MIB = 1024 * 1024


@dataclass(frozen=True)
class EngineSettings:
    """Per-instance engine settings the simulated layouts use (engine defaults)."""

    block_size: int = EngineConfig.block_size
    kv_cache_bytes: int = EngineConfig.kv_cache_bytes
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    chunked_prefill: bool = EngineConfig.chunked_prefill
    policy: str = "mixed"

    def spec(self, profile: Profile, threads: int, tp: int = 1) -> InstanceSpec:
        # kv_cache_bytes is per rank and each rank holds 1/tp of the KV heads (replicated heads ignored)
        blocks = self.kv_cache_bytes * tp // (profile.kv_bytes_per_token * self.block_size)
        return InstanceSpec(
            profile.cost(threads, tp),
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.chunked_prefill,
            max(1, blocks),
            self.block_size,
            self.policy,
        )


@dataclass(frozen=True)
class Candidate:
    num_prefill: int  # 0: colocated
    num_serving: int
    threads: int  # per instance (per rank of a tensor-parallel one)
    prefill_tp: int = 1  # ranks of each prefill instance
    serving_tp: int = 1  # ranks of each decode or colocated instance

    @property
    def name(self) -> str:
        if self.num_prefill == 0:
            base = "colocated" if self.num_serving == 1 else f"colocated x{self.num_serving}"
            return base if self.serving_tp == 1 else f"{base} tp{self.serving_tp}"
        base = f"{self.num_prefill}P{self.num_serving}D"
        return base if self.prefill_tp == self.serving_tp == 1 else f"{base} tp{self.prefill_tp}/{self.serving_tp}"

    @property
    def instances(self) -> int:
        return self.num_prefill + self.num_serving

    @property
    def ranks(self) -> int:
        """Cores shares (or GPUs) it takes: one per rank."""
        return self.num_prefill * self.prefill_tp + self.num_serving * self.serving_tp

    @classmethod
    def parse(cls, name: str, units: int, per_device: bool) -> Candidate:
        """``colocated``, ``colocated x2`` / ``colocatedx2`` or ``xPyD``, each optionally followed by
        ``tpN`` (colocated) or ``tpP/D`` (prefill and decode ranks per instance)."""
        text, _, tp = name.strip().lower().replace(" ", "").partition("tp")
        if text.startswith("colocated"):
            x, y = 0, int(text.removeprefix("colocated").removeprefix("x") or 1)
        elif "p" in text and text.endswith("d"):
            x, y = (int(v) for v in text[:-1].split("p"))
        else:
            raise ValueError(f"bad layout {name!r}: use colocated, colocatedx2, 1p1d, 2p1d, 1p1d tp2/1, ...")
        sizes = [int(v) for v in tp.split("/")] if tp else [1] * (1 if x == 0 else 2)
        if len(sizes) != (1 if x == 0 else 2) or min(sizes) < 1:
            raise ValueError(f"bad layout {name!r}: tensor-parallel sizes are tpN (colocated) or tpP/D")
        pt, dt = (1, sizes[0]) if x == 0 else (sizes[0], sizes[1])
        ranks = x * pt + y * dt
        if x < 0 or y < 1 or ranks > units:
            raise ValueError(f"layout {name!r} needs {ranks} instances or ranks; only {units} fit")
        return cls(x, y, 1 if per_device else units // ranks, pt, dt)


def candidates(
    units: int, max_instances: int | None = None, per_device: bool = False, tp_sizes: tuple[int, ...] = (1,)
) -> list[Candidate]:
    """Every colocated and xPyD layout with at most ``units`` instances, each instance on one of
    ``tp_sizes`` ranks, with at most ``units`` ranks in all."""
    limit = min(units, max_instances or units)
    out = []
    for total in range(1, limit + 1):
        for x in range(total):
            for pt in tp_sizes if x else (1,):
                for dt in tp_sizes:
                    ranks = x * pt + (total - x) * dt
                    if ranks <= units:
                        out.append(Candidate(x, total - x, 1 if per_device else units // ranks, pt, dt))
    return out


def build_layout(
    c: Candidate,
    profile: Profile,
    settings: EngineSettings,
    overheads: Overheads,
    local_prefill_below: int = 0,
    layerwise: bool = True,
    bandwidth: float | None = None,
) -> Layout:
    serving = settings.spec(profile, c.threads, c.serving_tp)
    prefill = settings.spec(profile, c.threads, c.prefill_tp)
    transfer = profile.transfer_cost(layerwise, bandwidth) if c.num_prefill else None
    return Layout(
        c.name,
        (serving,) * c.num_serving,
        (prefill,) * c.num_prefill,
        transfer,
        overheads,
        local_prefill_below if c.num_prefill else 0,
    )


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    summary: Summary
    utilization: dict[str, float]


def evaluate(
    layouts: list[tuple[Candidate, Layout]],
    workload: Workload,
    rate: float,
    num_requests: int,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    seed: int = 0,
) -> list[Prediction]:
    """Simulates every layout on the same requests and arrivals."""
    specs = workload.specs(num_requests, seed)
    arrivals = poisson_arrivals(rate, num_requests, seed)
    out = []
    for cand, layout in layouts:
        result = simulate(layout, specs, arrivals)
        summary = summarize(result.records, result.duration_s, slo_ttft_ms, slo_tpot_ms)
        out.append(Prediction(cand, summary, result.utilization))
    return out


# A profile whose step-cost fit misses its own samples by more than this on average (bench/plan/costmodel.py
# fit_error) predicts step times too roughly to rank layouts: the plan says so next to its answer.
FIT_ERROR_BOUND = 0.15


def recommend(predictions: list[Prediction]) -> Prediction:
    def score(p: Prediction) -> float:
        s = p.summary
        return s.goodput if s.goodput is not None else s.request_throughput

    best = max(score(p) for p in predictions)
    near = [p for p in predictions if score(p) >= 0.98 * best]
    return min(near, key=lambda p: (p.candidate.instances, p.summary.tpot.p99 or 0.0))


def format_table(predictions: list[Prediction], best: Prediction | None = None) -> str:
    """Markdown: one row per layout."""
    lines = [
        "| layout | threads | goodput (req/s) | SLO met | throughput (req/s) | TTFT ms mean/p50/p90/p99 "
        "| TPOT ms mean/p50/p90/p99 | busiest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in predictions:
        s = p.summary
        mark = " **(recommended)**" if p is best else ""
        busiest = max(p.utilization.items(), key=lambda kv: kv[1], default=("-", 0.0))
        good = "-" if s.goodput is None else f"{s.goodput:.3g}"
        met = "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.0f}%"
        lines.append(
            f"| {p.candidate.name}{mark} | {p.candidate.threads} | {good} | {met} | "
            f"{s.request_throughput:.3f} | {stats_row(s.ttft)} | {stats_row(s.tpot)} | "
            f"{busiest[0]} {100 * busiest[1]:.0f}% |"
        )
    return "\n".join(lines)


def max_rates(
    layouts: list[tuple[Candidate, Layout]],
    workload: Workload,
    rates: list[float],
    num_requests: int,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    target: float,
    seed: int = 0,
) -> dict[str, tuple[float | None, dict[float, float]]]:
    """Per layout: the highest of ``rates`` with ``target`` attainment (``bench/plan/sweep.py``:
    below the first rate missed) and the simulated attainment at each rate."""
    from bench.plan.sweep import max_rate, predicted_curve

    out = {}
    for cand, layout in layouts:
        curve = predicted_curve(layout, workload, rates, num_requests, slo_ttft_ms, slo_tpot_ms, seed)
        out[cand.name] = (max_rate(curve, target), curve)
    return out


def format_max_rates(found: dict[str, tuple[float | None, dict[float, float]]], target: float, units: int) -> str:
    from bench.plan.sweep import crossing

    lines = [
        f"| layout | highest rate at >= {100 * target:g}% (req/s) | per unit | crossing (req/s) | "
        "attainment at each rate |",
        "|---|---|---|---|---|",
    ]
    for name, (best, curve) in found.items():
        top = " (top of the ladder: at least)" if best is not None and best == max(curve) else ""
        cells = ", ".join(f"{r:.3g}: {100 * (a or 0):.0f}%" for r, a in curve.items())
        per = "-" if best is None else f"{best / units:.3g}"
        cross = crossing(curve, target)
        lines.append(
            f"| {name} | {'-' if best is None else f'{best:.3g}'}{top} | {per} | "
            f"{'-' if cross is None else f'{cross:.3g}'} | {cells} |"
        )
    return "\n".join(lines)


def meets(p: Prediction, target: float) -> bool:
    """At least ``target`` of its requests within both SLOs (with no SLO given, any layout does)."""
    return p.summary.slo_attainment is None or p.summary.slo_attainment >= target


def highest_rate_met(
    layouts: list[tuple[Candidate, Layout]],
    workload: Workload,
    rate: float,
    num_requests: int,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    target: float,
    seed: int = 0,
) -> tuple[float, str] | None:
    """Below ``rate``, where none meets the SLO: the highest rate of a ladder from ``rate``/32 (x1.25 a
    rung) at which some layout does, and that layout; None when none does even at ``rate``/32."""
    from bench.plan.sweep import ladder

    rates = [r for r in ladder(rate / 32, 1.25, 16) if r < rate]
    found = max_rates(layouts, workload, rates, num_requests, slo_ttft_ms, slo_tpot_ms, target, seed)
    met = [(best, name) for name, (best, _) in found.items() if best is not None]
    return max(met) if met else None


def poor_fits(profile: Profile) -> list[str]:
    """One line per thread count whose step-cost fit is worse than FIT_ERROR_BOUND."""
    return [
        f"warning: the step-cost fit for {threads} thread(s) misses its own samples by "
        f"{100 * error:.0f}% on average (bound {100 * FIT_ERROR_BOUND:.0f}%): predictions for it are rough; "
        f"profile again on a quieter machine, without --quick"
        for threads, error in sorted(profile.fit_errors.items())
        if error > FIT_ERROR_BOUND
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("profile")
    src.add_argument(
        "--model",
        metavar="DIR",
        help=f"model to profile now: a folder, or a built-in model ({', '.join(BUILTIN_MODELS)}) "
        f"from {MODEL_CACHE}, built there on first use",
    )
    src.add_argument("--profile", metavar="FILE", help="use a saved profile instead of profiling")
    src.add_argument("--save-profile", metavar="FILE", help="write the measured profile here")
    src.add_argument(
        "--threads", default=None, metavar="LIST", help="thread counts to profile (default: 1 and --cores, e.g. 1,2)"
    )
    src.add_argument("--quick", action="store_true", help="a small profiling grid (seconds, rougher)")
    src.add_argument(
        "--dtype", default=EngineConfig.dtype, choices=DTYPES, help="dtype to profile (default %(default)s)"
    )
    src.add_argument("--device", default=EngineConfig.device, help="torch device to profile (default %(default)s)")
    work = p.add_argument_group("workload")
    work.add_argument("--rate", type=float, metavar="R", help="Poisson arrivals per second (required)")
    work.add_argument("--num-requests", type=int, default=300, metavar="N", help="simulated requests (300)")
    work.add_argument("--prompt-len", default="512", metavar="SPEC", help="N, uniform(LO,HI), normal(M,S)")
    work.add_argument("--output-len", default="128", metavar="SPEC", help="same forms")
    work.add_argument("--mix", action="append", metavar="W:PROMPT:OUTPUT", help="a request class (repeat)")
    work.add_argument("--slo-ttft-ms", type=float, default=2000.0, metavar="MS", help="default 2000")
    work.add_argument("--slo-tpot-ms", type=float, default=100.0, metavar="MS", help="default 100")
    work.add_argument("--seed", type=int, default=0, help="seed of the simulated requests and arrivals (0)")
    cl = p.add_argument_group("cluster")
    cl.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count(),
        metavar="N",
        help="CPU cores shared by all instances (default: this machine's)",
    )
    cl.add_argument("--gpus", type=int, metavar="N", help="GPUs instead of cores: one instance per GPU")
    cl.add_argument("--max-instances", type=int, metavar="N", help="cap on x + y")
    cl.add_argument(
        "--tp",
        default="1",
        metavar="LIST",
        help="tensor-parallel sizes an instance may have, e.g. 1,2 (default 1); each rank takes a core share or a GPU",
    )
    cl.add_argument("--layouts", metavar="LIST", help="only these, e.g. colocated,1p1d,2p1d")
    cl.add_argument(
        "--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV block (default %(default)s)"
    )
    cl.add_argument(
        "--kv-cache-mib",
        type=int,
        default=EngineConfig.kv_cache_bytes // MIB,
        help="KV cache per instance (default %(default)s)",
    )
    cl.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        help="sequences an instance runs at once (default %(default)s)",
    )
    cl.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        help="tokens one engine step computes at most (default %(default)s)",
    )
    cl.add_argument(
        "--policy",
        choices=["mixed", "prefill_first"],
        default="mixed",
        help="step composition; the engine's is mixed (default)",
    )
    cl.add_argument(
        "--local-prefill-below",
        type=int,
        default=0,
        metavar="TOKENS",
        help="conditional disaggregation threshold (default 0: off)",
    )
    cl.add_argument("--transfer-gbps", type=float, help="override the measured transfer bandwidth (GB/s)")
    cl.add_argument(
        "--no-layerwise",
        dest="layerwise",
        action="store_false",
        help="KV sent after the whole prefill, not layer by layer",
    )
    cl.add_argument("--ingress-ms", type=float, default=2.0, help="client to engine (HTTP, tokenize), assumed 2")
    cl.add_argument("--egress-ms", type=float, default=0.5, help="engine to client per token, assumed 0.5")
    cl.add_argument("--pd-hop-ms", type=float, default=3.0, help="extra D-reserve + P-call hop, assumed 3")
    p.add_argument(
        "--max-rate",
        action="store_true",
        help="also find each layout's highest rate meeting the SLO (a ladder from --rate/4, x1.25)",
    )
    p.add_argument(
        "--attainment",
        type=float,
        default=90.0,
        metavar="PCT",
        help="share of requests that must meet both SLOs for a layout to count as meeting them (default 90)",
    )
    p.add_argument("--json", metavar="FILE", help="write predictions as JSON")


def _tp_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        raise ValueError(f"--tp takes sizes like 1,2, got {text!r}") from None
    if min(sizes) < 1:
        raise ValueError(f"--tp sizes must be 1 or more, got {text!r}")
    return sizes


def load_or_measure(args: argparse.Namespace, print_fn=print) -> Profile:
    if args.profile:
        return Profile.load(args.profile)
    if not args.model:
        raise ValueError("give --model DIR to profile, or --profile FILE")
    model = str(resolve_model(args.model, MODEL_CACHE))  # a folder, or a built-in model built on first use
    units = args.gpus or args.cores
    threads = sorted({int(t) for t in args.threads.split(",")}) if args.threads else sorted({1, units})
    grid = ProfileGrid.quick() if args.quick else ProfileGrid()
    profile = profile_engine(model, threads, grid, args.dtype, args.device, progress=print_fn)
    if args.save_profile:
        profile.save(args.save_profile)
        print_fn(f"profile: {args.save_profile}")
    return profile


def run(args: argparse.Namespace) -> int:
    if args.rate is None:
        raise ValueError("--rate is required (or `pdserve plan kv --model DIR` for a model's KV bytes)")
    workload = Workload.mix(args.mix) if args.mix else Workload.single(args.prompt_len, args.output_len)
    per_device = args.gpus is not None
    units = args.gpus if per_device else args.cores
    if not units or units < 1:
        raise ValueError("need at least one core or GPU")
    tp_sizes = _tp_sizes(args.tp)
    if args.layouts:
        cands = [Candidate.parse(n, units, per_device) for n in args.layouts.split(",")]
    else:
        cands = candidates(units, args.max_instances, per_device, tp_sizes)
    profile = load_or_measure(args)
    settings = EngineSettings(
        args.block_size, args.kv_cache_mib * MIB, args.max_num_seqs, args.max_num_batched_tokens, True, args.policy
    )
    overheads = Overheads(args.ingress_ms / 1000, args.egress_ms / 1000, args.pd_hop_ms / 1000)
    bandwidth = args.transfer_gbps * 1e9 if args.transfer_gbps else None
    layouts = [
        (c, build_layout(c, profile, settings, overheads, args.local_prefill_below, args.layerwise, bandwidth))
        for c in cands
    ]
    preds = evaluate(layouts, workload, args.rate, args.num_requests, args.slo_ttft_ms, args.slo_tpot_ms, args.seed)
    target = args.attainment / 100
    best = recommend(preds)
    meets_slo = meets(best, target)
    print(
        f"workload: {workload} at {args.rate:g} req/s, {args.num_requests} simulated requests; "
        f"SLO TTFT<={args.slo_ttft_ms:g}ms TPOT<={args.slo_tpot_ms:g}ms"
    )
    print(
        f"profile: {profile.model} ({profile.device}, {profile.dtype}), KV {profile.kv_bytes_per_token} B/token, "
        f"transfer {profile.transfer_bandwidth / 1e9:.2f} GB/s ({profile.transfer_source})"
    )
    for line in poor_fits(profile):
        print(line)
    print(format_table(preds, best if meets_slo else None))
    fallback = None
    if meets_slo:
        print(f"recommended: {best.candidate.name}")
    else:
        attained = best.summary.slo_attainment or 0.0
        print(
            f"no layout meets the SLO at {args.rate:g} req/s: the best, {best.candidate.name}, has "
            f"{100 * attained:.0f}% of requests within both (the bar is {args.attainment:g}%)"
        )
        fallback = highest_rate_met(
            layouts, workload, args.rate, args.num_requests, args.slo_ttft_ms, args.slo_tpot_ms, target, args.seed
        )
        if fallback is None:
            print(
                f"none meets it even at {args.rate / 32:.3g} req/s: this SLO is beyond these instances "
                "for this workload"
            )
        else:
            print(
                f"the highest rate a layout meets it at: {fallback[0]:.3g} req/s ({fallback[1]}); "
                f"plan again with --rate {fallback[0]:.3g}"
            )
    found = None
    if args.max_rate:
        from bench.plan.sweep import ladder

        found = max_rates(
            layouts,
            workload,
            ladder(args.rate / 4, 1.25, 16),
            args.num_requests,
            args.slo_ttft_ms,
            args.slo_tpot_ms,
            target,
            args.seed,
        )
        print(format_max_rates(found, target, units))
    if args.json:
        data = {
            "workload": str(workload),
            "rate": args.rate,
            "recommended": best.candidate.name if meets_slo else None,
            "highest_rate_met": None if fallback is None else {"rate": fallback[0], "layout": fallback[1]},
            "poor_fits": poor_fits(profile),
            "profile": {k: v for k, v in profile.to_json().items() if k != "samples"},
            "predictions": [
                {
                    "layout": p.candidate.name,
                    "threads": p.candidate.threads,
                    "summary": p.summary.to_json(),
                    "utilization": p.utilization,
                }
                for p in preds
            ],
        }
        if found is not None:
            from bench.plan.sweep import crossing

            data["max_rate"] = {
                name: {
                    "rate": best,
                    "crossing": crossing(curve, target),
                    "curve": {str(r): a for r, a in curve.items()},
                }
                for name, (best, curve) in found.items()
            }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"predictions: {args.json}")
    return 0
