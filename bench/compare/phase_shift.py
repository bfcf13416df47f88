"""``python -m bench.compare.phase_shift``: the planner against fixed P:D layouts on a trace whose mix shifts.

One pool of N instances, one trace of phases run back to back (by default
prompt-heavy, then output-heavy, then mixed; each ``--phase-s`` seconds of
Poisson arrivals at that phase's ``--rates``), run several ways, one after
the other on the same cores:

* every static layout ``kP(N-k)D`` for k in ``--statics`` (default: each k
  from 1 to N-1, or 7 evenly spaced when N > 8);
* the planner acting (``planner.mode act``, ``orchestrator pool``), from
  ``N/2`` of each role, switching instances in place.

Per layout and phase it reports goodput, the requests a second that met
both SLOs (``--ttft``, ``--tpot``; a failed request meets neither), and
attainment, the share that met them. The best static layout is the one
with the highest goodput over the whole trace; the per-phase oracle takes
each phase's best static layout. Ratios: the planner's goodput over the
best static layout's (whole trace) and over the oracle's (each phase). The
planner run also reports each switch and its seconds, and the planner's CPU
per decision, twice: the decision's own CPU (the planner's histogram: scrape
parsing, model, decision) and the planner process's whole CPU over the trace
(``/proc/PID/stat``: its HTTP reads, the scrapes' I/O, the switches' calls)
over the decisions it made; the switches made in each phase (a steady trace,
``--phases mixed,mixed,mixed``, should make none after its first phase). A
plot of its prefill share and attainment over time is written next to the
JSON.

Each layout's results are written to ``OUT/<layout>/layout.json`` as it ends;
``--reuse`` takes a layout's from there instead of running it again, so a
long comparison (32 instances: a minute to start each layout) can be run in
parts, each invocation a few layouts (``--statics``), the last one reporting
them all.

``--engine mock`` (the default) runs the simulated engine (engine/mock.py)
on a model folder without weights, its step times from ``--profile`` or a
built-in profile whose prefill costs ``--prefill-ms-per-token`` per token
and decode ``--decode-ms-per-seq`` per sequence and step, both multiplied by
``--slow-down`` (each instance does 1/S of the work, so 32 instances at the
rates of 4 keep the router's and the clients' work what the cores carry;
every request then takes S times as long, so give ``--ttft`` and ``--tpot``
S times their targets too). ``--engine model`` runs the real engine on the
model. With ``--max-moves`` the planner may switch several instances in one
decision (``planner.max_moves``), one after another.

Each instance's ports are picked below the host's ephemeral range: a prefill
server does not bind its KV port, and with 32 instances an outgoing
connection's local port had taken one, so its switch to decode failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import RunningCluster, free_port_pairs, free_ports, launch
from bench.load.loadgen import LoadConfig
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.serve import request_source, run_benchmark
from bench.load.workload import Workload
from bench.micro.mock_scale import cpu_seconds
from bench.plan.costmodel import StepCost
from bench.plan.profile import Profile
from engine.models import MODEL_CACHE, resolve_model

PHASES = {"prompt": ("900", "8"), "output": ("48", "160"), "mixed": ("400", "60")}  # prompt, output tokens


@dataclass
class PhaseResult:
    name: str
    seconds: float
    requests: int
    met: int
    failed: int

    @property
    def goodput(self) -> float:
        return self.met / self.seconds

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 0.0


@dataclass
class LayoutRun:
    name: str  # "2P2D" or "planner"
    phases: list[PhaseResult]
    records: list[tuple[str, float, dict]]  # (phase, start since the trace began, record) for the plot
    decisions: list[dict]
    cpu_per_decision_s: float | None = None
    process_cpu_per_decision_s: float | None = None  # the planner process's CPU over the trace / its decisions
    t0: float = 0.0  # when the trace began, on the monotonic clock the planner's decisions are stamped with
    phase_starts: tuple[float, ...] = ()

    @property
    def goodput(self) -> float:
        return sum(p.met for p in self.phases) / sum(p.seconds for p in self.phases)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="a built-in model or a model folder (default tiny)")
    p.add_argument("--model-cache", default=MODEL_CACHE, help="where built-in models are built")
    p.add_argument("--engine", choices=["mock", "model"], default="mock", help="the simulated engine or the model")
    p.add_argument("--instances", type=int, default=4, help="instances in the pool (default 4)")
    p.add_argument("--statics", default=None, help="prefill counts of the static layouts, e.g. 1,2,3")
    p.add_argument("--phases", default="prompt,output,mixed", help=f"phases in order, from {', '.join(PHASES)}")
    p.add_argument("--rates", default="5,5,4", help="requests a second of each phase (default 5,5,4)")
    p.add_argument("--phase-s", type=float, default=40.0, help="seconds of each phase (default 40)")
    p.add_argument("--ttft", type=float, default=2.0, help="TTFT target in seconds (default 2)")
    p.add_argument("--tpot", type=float, default=0.1, help="TPOT target in seconds (default 0.1)")
    p.add_argument("--profile", default=None, help="a `pdserve plan --save-profile` file for the mock engine")
    p.add_argument("--prefill-ms-per-token", type=float, default=1.0, help="built-in profile (default 1.0)")
    p.add_argument("--decode-ms-per-seq", type=float, default=1.0, help="built-in profile (default 1.0)")
    p.add_argument("--slow-down", type=float, default=1.0, help="multiply the built-in profile's costs")
    p.add_argument("--interval-s", type=float, default=2.0, help="the planner's interval (default 2)")
    p.add_argument("--cooldown-s", type=float, default=4.0, help="the planner's cooldown (default 4)")
    p.add_argument("--window-s", type=float, default=8.0, help="the seconds each decision reads (default 8)")
    p.add_argument("--max-moves", type=int, default=1, help="instances one decision may switch (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    p.add_argument("--out", default="runs/phase-shift", help="folder for configs, logs, JSON and the plot")
    p.add_argument("--skip-statics", action="store_true", help="run the planner alone (no ratios)")
    p.add_argument("--skip-planner", action="store_true", help="run the static layouts alone")
    p.add_argument("--reuse", action="store_true", help="take a layout's results from OUT/<layout>/layout.json")


def built_in_profile(args: argparse.Namespace, path: Path) -> Path:
    """A mock profile whose prefill is ``--prefill-ms-per-token`` a token and whose decode step is
    ``--decode-ms-per-seq`` per sequence, plus 2 ms a step, all times ``--slow-down``."""
    f = args.slow_down / 1000.0
    cost = StepCost(
        base=2 * f, per_token=args.prefill_ms_per_token * f, per_attn=0.0, per_seq=args.decode_ms_per_seq * f
    )
    Profile(args.model, "float32", "cpu", 2, 64, {1: cost}, {1: 0.0}, 1e9, 1e-4, "phase_shift").save(path)
    return path


def weightless(model: Path, folder: Path) -> Path:
    """The model folder without its weights (what a mock engine reads: config, tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    return folder


def cluster_config(args, model: Path, profile: Path | None, prefill: int, planner: bool, folder: Path) -> Path:
    n = args.instances
    ports = free_port_pairs(n)  # below the ephemeral range: see bench.load.cluster._free_run
    taken = set(ports) | {p + 1 for p in ports}
    router, planner_port = next(pair for pair in iter(lambda: free_ports(2), None) if not taken & set(pair))
    instances = [{"name": f"i{k}", "port": ports[k], "kv_port": ports[k] + 1} for k in range(n)]
    data: dict = {
        "model": str(model),
        "served_model_name": "m",
        "max_model_len": 2048,
        "engine": {"num_threads": 1, "prefix_caching": False, "max_num_seqs": 64},
        "router": {"port": router, "local_prefill_threshold": 0, "max_queued_requests": 4096, "queue_timeout_s": 60},
        "lease_s": 30,
        "prefill": instances[:prefill],
        "decode": instances[prefill:],
    }
    if args.engine == "mock":
        data["engine"] |= {"kind": "mock", "mock_profile": str(profile)}
    if planner:
        data["planner"] = {
            "mode": "act",
            "interval_s": args.interval_s,
            "window_s": args.window_s,
            "confirm": 2,
            "cooldown_s": args.cooldown_s,
            "max_moves": args.max_moves,
            "ttft_s": args.ttft,
            "tpot_s": args.tpot,
            "port": planner_port,
            **({"profile": str(profile)} if profile else {}),
        }
    path = folder / "cluster.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_trace(
    args,
    cluster: RunningCluster,
    builder: PromptBuilder,
    phases: list[str],
    rates: list[float],
    after_phase=lambda: None,
):
    """The phases back to back; each phase's records with its name and start (seconds into the trace), and
    the trace's start on the monotonic clock (``time.perf_counter`` is CLOCK_MONOTONIC on Linux, as the
    planner's ``time.monotonic``). ``after_phase`` is called as each phase ends."""
    out, t0 = [], time.perf_counter()
    for k, (phase, rate) in enumerate(zip(phases, rates)):
        prompt, output = PHASES[phase]
        config = LoadConfig(
            url=cluster.url, model="m", rate=rate, duration=args.phase_s, request_timeout=120.0, seed=args.seed + k
        )
        source = request_source(Workload.single(prompt, output), builder, "tokens", args.seed + k)
        started = time.perf_counter() - t0
        print(f"  phase {phase}: {rate:g} req/s for {args.phase_s:g} s", file=sys.stderr, flush=True)
        result = run_benchmark(config, source, progress=False)
        out.append((phase, started, result.records))
        after_phase()
    return out, t0


def phase_results(args, trace) -> list[PhaseResult]:
    results = []
    for phase, _, records in trace:
        met = sum(1 for r in records if r.meets(args.ttft, args.tpot))
        failed = sum(1 for r in records if not r.ok)
        results.append(PhaseResult(phase, args.phase_s, len(records), met, failed))
    return results


def plot_points(args, trace) -> list[tuple[str, float, dict]]:
    """Each request: its phase, when it was sent (seconds into the trace: a record's times count from its
    phase's start), whether it met both SLOs, and its error if it failed."""
    return [
        (phase, started + r.start, {"ok": r.ok, "met": r.meets(args.ttft, args.tpot), "error": r.error})
        for phase, started, records in trace
        for r in records
    ]


class PlannerReads:
    """What the bench reads off the planner of a run: its decisions (collected after every phase, as
    ``/decisions`` keeps only the last 200), its decisions' CPU, and its process's CPU over the trace."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.decisions: dict[float, dict] = {}
        self._cpu0, self._count0 = cpu_seconds(pid), decision_count(self._metrics())

    def _metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def collect(self) -> None:
        for d in httpx.get(f"{self.url}/decisions", timeout=10).json()["decisions"]:
            self.decisions[d["at"]] = d

    def finish(self) -> tuple[list[dict], float | None, float | None]:
        """The decisions in order, the mean CPU of a decision, and the process's CPU a decision."""
        cpu = cpu_seconds(self.pid) - self._cpu0
        page = self._metrics()
        self.collect()
        made = decision_count(page) - self._count0
        return [self.decisions[at] for at in sorted(self.decisions)], decision_cpu(page), cpu / made if made else None


def run_layout(args, model, profile, builder, phases, rates, prefill: int | None, out: Path) -> LayoutRun:
    """``prefill`` None: the planner, from half the pool in each role."""
    n = args.instances
    name = "planner" if prefill is None else f"{prefill}P{n - prefill}D"
    folder = out / name
    if args.reuse and (folder / "layout.json").is_file():
        print(f"{name}: results of an earlier run, {folder / 'layout.json'}", file=sys.stderr, flush=True)
        return load_layout(folder / "layout.json")
    config = cluster_config(args, model, profile, prefill or n // 2, prefill is None, folder)
    print(f"{name}: starting {n} instances", file=sys.stderr, flush=True)
    cluster = launch(config, folder / "run", cores=sorted(os.sched_getaffinity(0)))
    try:
        reads = None
        if prefill is None:
            planner_url = f"http://127.0.0.1:{yaml.safe_load(config.read_text())['planner']['port']}"
            reads = PlannerReads(planner_url, cluster.processes("planner")[0]["pid"])
        trace, t0 = run_trace(args, cluster, builder, phases, rates, reads.collect if reads else lambda: None)
        decisions, cpu, process_cpu = reads.finish() if reads else ([], None, None)
    finally:
        left = cluster.stop()
        if left:
            print(f"{name}: killed {left} after the launcher stopped", file=sys.stderr)
    starts = tuple(started for _, started, _ in trace)
    run = LayoutRun(name, phase_results(args, trace), plot_points(args, trace), decisions, cpu, process_cpu, t0, starts)
    save_layout(run, folder / "layout.json")
    return run


def save_layout(run: LayoutRun, path: Path) -> None:
    data = vars(run) | {"phases": [vars(p) for p in run.phases]}
    path.write_text(json.dumps(data, default=str))


def load_layout(path: Path) -> LayoutRun:
    data = json.loads(path.read_text())
    data["phases"] = [PhaseResult(**p) for p in data["phases"]]
    data["records"] = [tuple(r) for r in data["records"]]
    data["phase_starts"] = tuple(data["phase_starts"])
    return LayoutRun(**data)


def decision_count(metrics: str) -> float:
    """The decisions the planner made, every action together."""
    return sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("pdserve_planner_decisions_total{")
    )


def decision_cpu(metrics: str) -> float | None:
    values = {}
    for line in metrics.splitlines():
        for key in ("pdserve_planner_decision_cpu_seconds_sum", "pdserve_planner_decision_cpu_seconds_count"):
            if line.startswith(key + " "):
                values[key] = float(line.split()[-1])
    count = values.get("pdserve_planner_decision_cpu_seconds_count", 0.0)
    return values["pdserve_planner_decision_cpu_seconds_sum"] / count if count else None


def switches_per_phase(run: LayoutRun, made: list[dict]) -> list[int]:
    """How many of ``made`` (``switches``) began in each phase."""
    bounds = [*run.phase_starts[1:], math.inf]
    return [sum(1 for s in made if lo <= s["at_s"] < hi) for lo, hi in zip((-math.inf, *bounds[:-1]), bounds)]


def switches(run: LayoutRun) -> list[dict]:
    """Each switch carried out: when (seconds into the trace), which way, how long it took."""
    done = []
    for d in run.decisions:
        for text in (d.get("carried_out") or "").split("; "):  # a decision's moves, one after another
            if text.startswith("switched "):
                seconds = float(text.rsplit(" in ", 1)[1].split()[0])
                done.append({"at_s": round(d["at"] - run.t0, 1), "what": text.split(" in ")[0], "seconds": seconds})
    return done


def failure_kinds(runs: list[LayoutRun]) -> dict[str, dict[str, int]]:
    """Per layout with failed requests: how many failed with each error (its first 80 characters)."""
    out: dict[str, dict[str, int]] = {}
    for r in runs:
        for _, _, rec in r.records:
            if not rec["ok"]:
                kind = str(rec.get("error") or "")[:80]
                out.setdefault(r.name, {})[kind] = out.get(r.name, {}).get(kind, 0) + 1
    return out


def report(runs: list[LayoutRun], phases: list[str]) -> tuple[str, dict]:
    statics = [r for r in runs if r.name != "planner"]
    planner = next((r for r in runs if r.name == "planner"), None)
    head = "| layout | " + " | ".join(f"{p}: goodput (attainment)" for p in phases) + " | whole trace goodput |"
    lines = [head, "|" + "---|" * (len(phases) + 2)]
    for r in runs:
        cells = [f"{p.goodput:.2f} ({p.attainment:.0%}{f', {p.failed} failed' if p.failed else ''})" for p in r.phases]
        lines.append(f"| {r.name} | " + " | ".join(cells) + f" | {r.goodput:.2f} |")
    errors = failure_kinds(runs)
    if errors:
        lines.append("")
        lines.append("failed requests: " + "; ".join(f"{name}: {kinds}" for name, kinds in errors.items()))
    summary: dict = {}
    if statics and planner is not None:
        best = max(statics, key=lambda r: r.goodput)
        oracle = [max(statics, key=lambda r, k=k: r.phases[k].goodput) for k in range(len(phases))]
        summary["best_static"] = best.name
        summary["planner_over_best_static"] = planner.goodput / best.goodput if best.goodput else math.inf
        summary["planner_over_oracle"] = {
            p: (planner.phases[k].goodput / o.phases[k].goodput if o.phases[k].goodput else math.inf)
            for k, (p, o) in enumerate(zip(phases, oracle))
        }
        summary["oracle_layouts"] = {p: o.name for p, o in zip(phases, oracle)}
        lines.append("")
        lines.append(
            f"planner / best static layout ({best.name}), whole trace: {summary['planner_over_best_static']:.2f}x"
        )
        for p, o in zip(phases, oracle):
            lines.append(f"planner / per-phase oracle ({o.name}) in {p}: {summary['planner_over_oracle'][p]:.2f}x")
    if planner is not None:
        made = switches(planner)
        per_phase = switches_per_phase(planner, made) if planner.phase_starts else []
        summary["switches"] = made
        summary["switches_per_phase"] = per_phase
        summary["planner_cpu_per_decision_s"] = planner.cpu_per_decision_s
        summary["planner_process_cpu_per_decision_s"] = planner.process_cpu_per_decision_s
        lines.append("")
        lines.append(
            f"switches: {len(made)}; " + "; ".join(f"{s['what']} at {s['at_s']} s ({s['seconds']:.2f} s)" for s in made)
        )
        if per_phase:
            lines.append("switches per phase: " + ", ".join(f"{p} {k}" for p, k in zip(phases, per_phase)))
        if planner.cpu_per_decision_s is not None:
            lines.append(f"planner CPU per decision: {planner.cpu_per_decision_s * 1000:.2f} ms")
        if planner.process_cpu_per_decision_s is not None:
            lines.append(
                f"planner process CPU per decision (all its work over the trace): "
                f"{planner.process_cpu_per_decision_s * 1000:.2f} ms"
            )
    return "\n".join(lines), summary


def plot(run: LayoutRun, path: Path) -> None:
    """The planner's instances per role over the trace, and the share of requests meeting both SLOs per
    10 s (by when they were sent); dashed lines where a phase begins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    xs = [d["at"] - run.t0 for d in run.decisions]
    top.step(xs, [d["instances"]["prefill"] for d in run.decisions], where="post", label="prefill servers")
    top.step(xs, [d["instances"]["decode"] for d in run.decisions], where="post", label="decode servers")
    top.set_ylabel("instances in rotation")
    top.legend()
    buckets: dict[int, list[bool]] = {}
    for _, at, rec in run.records:
        buckets.setdefault(int(at // 10), []).append(bool(rec["met"]))
    keys = sorted(buckets)
    bottom.plot([10 * k + 5 for k in keys], [sum(buckets[k]) / len(buckets[k]) for k in keys], marker="o")
    bottom.set_ylabel("SLO attainment (per 10 s)")
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_xlabel("seconds into the trace")
    for axis in (top, bottom):
        for start in run.phase_starts:
            axis.axvline(start, color="grey", linestyle="--", linewidth=0.8)
    top.set_xlim(left=-5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    phases = args.phases.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or len(rates) != len(phases) or args.instances < 2 or (args.skip_statics and args.skip_planner):
        print(
            f"phase_shift: error: phases from {list(PHASES)}, one rate each, 2 or more instances, and a layout to run",
            file=sys.stderr,
        )
        return 2
    n = args.instances
    statics = [int(k) for k in args.statics.split(",")] if args.statics else None
    if statics is None:
        statics = list(range(1, n)) if n <= 8 else sorted({max(1, min(n - 1, round(n * f / 8))) for f in range(1, 8)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model, args.model_cache)
    profile = None
    if args.engine == "mock":
        model = weightless(model, out / "model")
        profile = Path(args.profile) if args.profile else built_in_profile(args, out / "profile.json")
    builder = PromptBuilder(load_tokenizer(model))
    layouts: list[int | None] = ([] if args.skip_statics else list(statics)) + ([] if args.skip_planner else [None])
    runs = [run_layout(args, model, profile, builder, phases, rates, k, out) for k in layouts]
    table, summary = report(runs, phases)
    print(table)
    planner = next((r for r in runs if r.name == "planner"), None)
    if planner is not None:
        plot(planner, out / "planner.png")
    data = {
        "args": vars(args),
        "runs": [
            {
                "name": r.name,
                "goodput": r.goodput,
                "phases": [vars(p) for p in r.phases],
                "phase_starts": r.phase_starts,
                "decisions": r.decisions,
                "t0": r.t0,
                "requests": r.records,
            }
            for r in runs
        ],
        "summary": summary,
    }
    (out / "phase_shift.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"results: {out / 'phase_shift.json'}, plot: {out / 'planner.png'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare.phase_shift", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
