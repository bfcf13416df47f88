"""``pdserve bench compare --sweep``: the highest rate each layout serves at the SLO.

For every scenario, a ladder of arrival rates (``bench/plan/sweep.py``); at each
rate the scenario's rounds go to every layout in ABBA order
(``compare_run.run_scenario``: same prompts and arrival pattern on every layout),
and a layout leaves the ladder once it misses even the loosest SLO scale (its
goodput at every scale is then known),
and the ladder stops when every layout has missed or when the scenario's
share of ``--time-budget`` would run out. Each round sends at least the
scenario's ``min_span`` seconds of arrivals, so a high rate is a sustained
load and not a burst the engines drain before it builds a queue. The
planner's attainment at each rate, for every layout, is the calibrated
simulation of exactly the requests sent. Writes ``sweep.md``, ``sweep.json`` and one PNG per scenario
(attainment vs rate, and the highest rate vs an SLO scale).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.compare.compare_run import calibrate_side, calibration_record, run_scenario, simulated
from bench.compare.scenarios import Scenario
from bench.load.workload import Workload
from bench.plan.sweep import SLO_SCALES, attainment, crossing, ladder, max_rate, ratio


@dataclass(frozen=True)
class LadderSpec:
    start: float  # req/s
    factor: float
    rungs: int
    min_span_s: float = 0.0  # each round sends at least this many seconds of arrivals

    def requests_per_round(self, rate: float, at_least: int) -> int:
        return max(at_least, math.ceil(rate * self.min_span_s))


# Sized for the ~90M model on 2 cores: each ladder starts where both layouts meet the SLO
# and climbs past where they miss it.
LADDERS = {
    "prefill-heavy": LadderSpec(0.18, 1.5, 7, min_span_s=30.0),
    "short": LadderSpec(1.2, 1.5, 6, min_span_s=10.0),
}
DEFAULT_SCENARIOS = "short,prefill-heavy"  # short first: the time it leaves goes to the slow one
QUICK = Scenario(
    "quick",
    "short prompts and answers on the tiny model (CI smoke)",
    Workload.single("uniform(16,48)", "8"),
    num_requests=8,
    slo_ttft_ms=3000,
    slo_tpot_ms=300,
)
QUICK_LADDER = LadderSpec(2.0, 4.0, 2)


@dataclass
class Rung:
    rate: float
    runs: dict  # layout name -> compare_run.Run
    predicted_records: dict  # layout name -> the simulated records of the same requests
    wall_s: float

    @property
    def num_requests(self) -> int:
        """Requests sent to each layout that ran (the same ones on all)."""
        return next(iter(self.runs.values())).scenario.num_requests


@dataclass
class ScenarioSweep:
    scenario: Scenario
    rungs: list[Rung]
    stopped: str
    calibration: dict = field(default_factory=dict)  # layout -> compare_run.calibration_record its predictions used

    def curve(self, layout: str, scale: float = 1.0, predicted: bool = False) -> dict[float, float | None]:
        """Attainment per rate: measured where the layout ran (up to its first miss),
        predicted at every rung."""
        s = self.scenario
        if predicted:
            return {
                g.rate: attainment(g.predicted_records[layout], s.slo_ttft_ms, s.slo_tpot_ms, scale) for g in self.rungs
            }
        return {
            g.rate: attainment(g.runs[layout].records, s.slo_ttft_ms, s.slo_tpot_ms, scale)
            for g in self.rungs
            if layout in g.runs
        }

    def round_curve(self, layout: str, k: int) -> dict[float, float | None]:
        return {
            g.rate: g.runs[layout].rounds[k].slo_attainment
            for g in self.rungs
            if layout in g.runs and k < len(g.runs[layout].rounds)
        }


DOWN_STEPS = 2  # rungs below the ladder for a layout that misses at its first rate


def sweep_scenario(
    scenario: Scenario,
    rates: list[float],
    spec: LadderSpec,
    per_round: int,
    sides: list,
    ctx: dict,
    target: float,
    deadline: float,
) -> ScenarioSweep:
    """Climbs ``rates``. A layout that misses at the first rate is measured one ladder
    step below it, then another (``DOWN_STEPS``), before the climb goes on, so its
    goodput is found even when the machine is slower than the ladder was sized for."""
    rungs: list[Rung] = []
    climbing = list(sides)
    stopped = f"all {len(rates)} rates measured"
    pending = list(rates)
    last: Rung | None = None
    downs = 0

    def unmet() -> list:
        """The layouts that have met the SLO at no rate yet."""
        so_far = ScenarioSweep(scenario, rungs, "")
        return [s for s in sides if max_rate(so_far.curve(s.name), target) is None]

    while pending:
        rate = pending.pop(0)
        below = rate < rates[0]
        who = unmet() if below else climbing
        n = scenario.rounds * spec.requests_per_round(rate, per_round)
        # Arrivals at another rate span another time: last.wall_s scaled by the span of arrivals
        # (queueing at overload adds a tail, so the budget is a soft bound).
        if last is not None:
            guess = last.wall_s * (n / rate) / (last.num_requests / last.rate) * len(who) / len(last.runs)
            if time.time() + guess > deadline:
                stopped = f"time budget: stopped before {rate:g} req/s"
                break
        t0 = time.time()
        at = replace(scenario, rate=rate, num_requests=n)
        runs = {r.layout: r for r in run_scenario(at, who, ctx)}
        sent = next(iter(runs.values())).records  # same lengths and send times on every layout
        preds = {s.name: simulated(s.layout, at, runs[s.name].records if s.name in runs else sent) for s in sides}
        last = Rung(rate, runs, preds, time.time() - t0)
        rungs.insert(sum(g.rate < rate for g in rungs), last)
        print(
            f"   {scenario.name} at {rate:g} req/s ({n} requests): attainment "
            + ", ".join(f"{name} {100 * (r.measured.slo_attainment or 0):.0f}%" for name, r in runs.items()),
            flush=True,
        )
        if rate <= rates[0]:
            if unmet() and downs < DOWN_STEPS:
                downs += 1
                pending.insert(0, round(rates[0] / spec.factor**downs, 6))
            if below:
                continue
        # A layout stays while it meets the loosest SLO scale: every scale's highest rate is then known.
        loosest = max(SLO_SCALES)
        climbing = [
            s
            for s in climbing
            if (attainment(runs[s.name].records, scenario.slo_ttft_ms, scenario.slo_tpot_ms, loosest) or 0) >= target
        ]
        if not climbing:
            stopped = f"every layout has missed: the last at {rate:g} req/s"
            break
    return ScenarioSweep(scenario, rungs, stopped)


def sweep_all(scenarios: list[Scenario], sides: list, ctx: dict, args, quick: bool) -> list[ScenarioSweep]:
    """Every scenario's ladder. Each side is probed again before every scenario but the
    first (its launch calibration came just before that one), and calibrated from all
    its probes so far (``compare_run.calibrate_side``): the machine as the scenario's rungs
    will see it, and more requests than one set of probes."""
    out = []
    target = args.attainment / 100
    for i, scenario in enumerate(scenarios):
        if i:
            print(f"== calibrating again before {scenario.name}", flush=True)
            for side in sides:
                calibrate_side(side, ctx)
        spec = QUICK_LADDER if quick else LADDERS.get(scenario.name, LadderSpec(scenario.rate, 1.5, 6))
        rates = (
            sorted(parse_rate_list(args.sweep_rates))
            if args.sweep_rates
            else ladder(spec.start, spec.factor, spec.rungs)
        )
        share = (ctx["deadline"] - time.time()) / (len(scenarios) - i)
        print(
            f"== sweep {scenario.name}: rates {rates}, at least {args.sweep_requests} requests and "
            f"{spec.min_span_s:g} s of arrivals per round, {share / 60:.1f} min",
            flush=True,
        )
        calibration = {side.name: calibration_record(side) for side in sides}
        swept = sweep_scenario(scenario, rates, spec, args.sweep_requests, sides, ctx, target, time.time() + share)
        out.append(replace(swept, calibration=calibration))
    return out


def parse_rate_list(text: str) -> list[float]:
    """``0.1,0.2,0.4`` -> rates (each > 0)."""
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"bad --sweep-rates {text!r}: use numbers, e.g. 0.1,0.2,0.4") from None
    if not rates or min(rates) <= 0:
        raise ValueError(f"bad --sweep-rates {text!r}: give rates > 0")
    return rates


def fmt_num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def calibration_lines(sw: ScenarioSweep) -> list[str]:
    """The probe calibration the scenario's predictions used, per layout."""
    if not sw.calibration:
        return []
    parts = [
        f"{name} +{c['found']['step_ms']:.1f} ms per step, +{c['found']['seq_ms']:.1f} ms per sequence, "
        f"+{c['found']['request_ms']:.1f} ms per request, prefill x{c['found']['prefill_scale']:.2f}"
        for name, c in sw.calibration.items()
    ]
    return ["Calibrated just before this scenario: " + "; ".join(parts) + ".", ""]


def scenario_lines(sw: ScenarioSweep, names: list[str], cores: int, target: float, plot: Path) -> list[str]:
    s = sw.scenario
    base, other = names
    lines = [
        f"## {s.name}",
        "",
        f"{s.description}. Workload `{s.workload}`; SLO TTFT {s.slo_ttft_ms:g} ms, "
        f"TPOT {s.slo_tpot_ms:g} ms; {s.rounds} ABBA rounds per rate. Ladder: {sw.stopped}.",
        "",
        *calibration_lines(sw),
        "| rate (req/s) | requests | " + " | ".join(f"{n} measured (predicted)" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for g in sw.rungs:
        cells = [
            f"{fmt_pct(g.runs[n].measured.slo_attainment) if n in g.runs else 'left the ladder'} "
            f"({fmt_pct(attainment(g.predicted_records[n], s.slo_ttft_ms, s.slo_tpot_ms))})"
            for n in names
        ]
        lines.append(f"| {g.rate:g} | {g.num_requests} | " + " | ".join(cells) + " |")
    meas = {n: max_rate(sw.curve(n), target) for n in names}
    cross = {n: crossing(sw.curve(n), target) for n in names}
    pred = {n: crossing(sw.curve(n, predicted=True), target) for n in names}
    rounds = min((len(g.runs[n].rounds) for g in sw.rungs for n in names if n in g.runs), default=0)
    per_round = [
        ratio(max_rate(sw.round_curve(other, k), target), max_rate(sw.round_curve(base, k), target))
        for k in range(rounds)
    ]
    lines += [
        "",
        f"Highest rate with >= {100 * target:g}% of requests meeting both SLOs: the last rung met before "
        "the first missed, and where attainment crosses the target (linear between those two rungs; the "
        "planner's crossing is read off its curve the same way):",
        "",
        "| layout | highest rung met (req/s) | per core | crossing (req/s) | planner's crossing | "
        "planner vs measured |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:
        top = max(sw.curve(n), default=None)
        at_least = meas[n] is not None and meas[n] == top
        mark = " (top of the ladder: at least)" if at_least else ""
        err = ratio(pred[n], cross[n])
        lines.append(
            f"| {n} | {fmt_num(meas[n])}{mark} | {fmt_num(None if meas[n] is None else meas[n] / cores)} | "
            f"{'above the ladder' if at_least else fmt_num(cross[n])} | {fmt_num(pred[n])} | "
            f"{'-' if err is None else f'{100 * (err - 1):+.0f}%'} |"
        )
    r = ratio(meas[other], meas[base])
    rc = ratio(cross[other], cross[base])
    lines += [
        "",
        f"**{other} / {base}: {'-' if r is None else f'{r:.2f}x'}** at the highest rung met"
        f"{'' if rc is None else f', {rc:.2f}x at the crossings'} (same cores, so per core too); per round "
        "(highest rung met): " + (", ".join("-" if x is None else f"{x:.2f}x" for x in per_round) or "-") + ".",
        "",
        "SLO scale (both SLOs multiplied): highest rung met per layout",
        "",
        "| scale | " + " | ".join(names) + " | wins |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    winners = {}
    for scale in SLO_SCALES:
        best = {n: max_rate(sw.curve(n, scale), target) for n in names}
        top = max((v for v in best.values() if v is not None), default=None)
        winners[scale] = [] if top is None else [n for n in names if best[n] == top]
        lines.append(
            f"| {scale:g} | " + " | ".join(fmt_num(best[n]) for n in names) + f" | {', '.join(winners[scale]) or '-'} |"
        )
    return lines + ["", verdict(winners, names), "", f"![attainment vs rate and SLO scale]({plot.name})", ""]


def verdict(winners: dict[float, list[str]], names: list[str]) -> str:
    """Who carries the higher rate at which SLO scales, in words, from the measured curves."""
    groups: dict[str, list[str]] = {}
    for scale, who in winners.items():
        key = (
            "neither layout meets the SLO"
            if not who
            else f"{who[0]} carries more"
            if len(who) == 1
            else "the layouts tie (same highest rung)"
        )
        groups.setdefault(key, []).append(f"{scale:g}")
    parts = [f"{key} at SLO scale {', '.join(scales)}" for key, scales in groups.items()]
    return "Measured: " + "; ".join(parts) + "."


def plot_sweep(sw: ScenarioSweep, names: list[str], target: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, n in enumerate(names):
        color = f"C{i}"
        for predicted, style in ((False, "-o"), (True, "--x")):
            c = sw.curve(n, predicted=predicted)
            left.plot(
                list(c),
                [100 * (v or 0) for v in c.values()],
                style,
                color=color,
                label=f"{n} {'predicted' if predicted else 'measured'}",
            )
            best = [max_rate(sw.curve(n, s, predicted), target) or 0 for s in SLO_SCALES]
            right.plot(SLO_SCALES, best, style, color=color, label=f"{n} {'predicted' if predicted else 'measured'}")
    left.axhline(100 * target, color="grey", lw=0.8)
    left.set(
        xlabel="rate (req/s)",
        ylabel="SLO attainment (%)",
        title=f"{sw.scenario.name}: attainment vs rate",
        ylim=(0, 105),
    )
    right.set(
        xlabel="SLO scale (x TTFT and TPOT SLO)",
        ylabel=f"highest rate at >= {100 * target:g}% (req/s)",
        title="highest rate vs SLO scale",
        ylim=(0, None),
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_sweep(out: Path, sweeps: list[ScenarioSweep], names: list[str], meta: dict, target: float) -> Path:
    cores = len(meta["cpus"])
    lines = [
        f"# Goodput sweep: {' vs '.join(names)} on the same cores",
        "",
        f"- model `{meta['model']}`; cores {meta['cpus']}; command `{meta['command']}` ({meta['wall_s'] / 60:.1f} min)",
        f"- goodput = the highest rate on the ladder with >= {100 * target:g}% of requests meeting both the "
        "TTFT and the TPOT SLO, below the first rate that misses; predicted = the planner's simulation "
        "(profile + probe calibration) of exactly the requests sent.",
        "",
    ]
    data = []
    for sw in sweeps:
        plot = plot_sweep(sw, names, target, out / f"sweep-{sw.scenario.name}.png")
        lines += scenario_lines(sw, names, cores, target, plot)
        data.append(
            {
                "scenario": sw.scenario.name,
                "stopped": sw.stopped,
                "slo_ttft_ms": sw.scenario.slo_ttft_ms,
                "slo_tpot_ms": sw.scenario.slo_tpot_ms,
                "calibration": sw.calibration,
                "max_rate": {n: max_rate(sw.curve(n), target) for n in names},
                "predicted_max_rate": {n: max_rate(sw.curve(n, predicted=True), target) for n in names},
                "crossing": {n: crossing(sw.curve(n), target) for n in names},
                "predicted_crossing": {n: crossing(sw.curve(n, predicted=True), target) for n in names},
                "curves": {n: {str(k): v for k, v in sw.curve(n).items()} for n in names},
                "predicted_curves": {n: {str(k): v for k, v in sw.curve(n, predicted=True).items()} for n in names},
                "rungs": [
                    {
                        "rate": g.rate,
                        "wall_s": g.wall_s,
                        "measured": {n: r.measured.to_json() for n, r in g.runs.items()},
                        "rounds": {n: [x.to_json() for x in r.rounds] for n, r in g.runs.items()},
                        "calibration": {n: r.calibration for n, r in g.runs.items()},
                        "engines": {n: r.engines for n, r in g.runs.items()},
                        "requests": {n: [x.to_json() for x in r.records] for n, r in g.runs.items()},
                        "predicted_requests": {n: [r.to_json() for r in g.predicted_records[n]] for n in names},
                    }
                    for g in sw.rungs
                ],
            }
        )
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "target": target, "scenarios": data}, indent=1) + "\n")
    path = out / "sweep.md"
    path.write_text("\n".join(lines) + "\n")
    return path
