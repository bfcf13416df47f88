"""``pdserve bench compare --sweep``: the highest rate each layout serves at the SLO.

For every scenario, a ladder of arrival rates (``bench/sweep.py``); at each
rate the scenario's rounds go to every layout in ABBA order
(``compare.run_scenario``: same prompts and arrival pattern on every layout),
and the ladder stops when every layout has missed the attainment target or
when the scenario's share of ``--time-budget`` would run out. The planner's
attainment at each rate is the calibrated simulation of exactly the
requests sent. Writes ``sweep.md``, ``sweep.json`` and one PNG per scenario
(attainment vs rate, and the highest rate vs an SLO scale).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench.scenarios import Scenario
from bench.sweep import SLO_SCALES, attainment, keep_climbing, ladder, max_rate, ratio
from bench.workload import Workload

# (first rate, factor, rungs) per scenario, sized for the ~90M model on 2 cores.
LADDERS = {"prefill-heavy": (0.12, 1.5, 6), "short": (1.0, 1.5, 6)}
DEFAULT_SCENARIOS = "short,prefill-heavy"  # short first: the time it leaves goes to the slow one
QUICK = Scenario("quick", "short prompts and answers on the tiny model (CI smoke)",
                 Workload.single("uniform(16,48)", "8"), num_requests=8, slo_ttft_ms=3000, slo_tpot_ms=300)
QUICK_LADDER = (2.0, 4.0, 2)


@dataclass
class Rung:
    rate: float
    runs: dict  # layout name -> compare.Run
    predicted_records: dict  # layout name -> the simulated records of the same requests
    wall_s: float


@dataclass
class ScenarioSweep:
    scenario: Scenario
    rungs: list[Rung]
    stopped: str

    def curve(self, layout: str, scale: float = 1.0, predicted: bool = False) -> dict[float, float | None]:
        s = self.scenario
        return {g.rate: attainment(g.predicted_records[layout] if predicted else g.runs[layout].records,
                                   s.slo_ttft_ms, s.slo_tpot_ms, scale) for g in self.rungs}

    def round_curve(self, layout: str, k: int) -> dict[float, float | None]:
        return {g.rate: g.runs[layout].rounds[k].slo_attainment for g in self.rungs
                if k < len(g.runs[layout].rounds)}


def sweep_scenario(scenario: Scenario, rates: list[float], sides: list, ctx: dict, target: float,
                   deadline: float) -> ScenarioSweep:
    from bench.compare import run_scenario, simulated

    rungs: list[Rung] = []
    stopped = f"all {len(rates)} rates measured"
    for rate in rates:
        # A rung at a higher rate sends the same requests sooner: its arrivals span last.rate / rate of
        # the last rung's (queueing at overload adds a tail, so the budget is a soft bound).
        if rungs and time.time() + rungs[-1].wall_s * rungs[-1].rate / rate > deadline:
            stopped = f"time budget: stopped before {rate:g} req/s"
            break
        t0 = time.time()
        at = replace(scenario, rate=rate)
        runs = {r.layout: r for r in run_scenario(at, sides, ctx)}
        preds = {s.name: simulated(s.layout, at, runs[s.name].records) for s in sides}
        rungs.append(Rung(rate, runs, preds, time.time() - t0))
        curves = {name: {g.rate: g.runs[name].measured.slo_attainment for g in rungs} for name in runs}
        print(f"   {scenario.name} at {rate:g} req/s: attainment " + ", ".join(
            f"{n} {100 * (c[rate] or 0):.0f}%" for n, c in curves.items()), flush=True)
        if not keep_climbing(curves, target):
            stopped = f"every layout missed at {rate:g} req/s"
            break
    return ScenarioSweep(scenario, rungs, stopped)


def sweep_all(scenarios: list[Scenario], sides: list, ctx: dict, args, quick: bool) -> list[ScenarioSweep]:
    out = []
    target = args.attainment / 100
    for i, scenario in enumerate(scenarios):
        start, factor, count = QUICK_LADDER if quick else LADDERS.get(scenario.name, (scenario.rate, 1.5, 6))
        rates = sorted(parse_rate_list(args.sweep_rates)) if args.sweep_rates else ladder(start, factor, count)
        share = (ctx["deadline"] - time.time()) / (len(scenarios) - i)
        s = replace(scenario, num_requests=scenario.rounds * args.sweep_requests)
        print(f"== sweep {scenario.name}: rates {rates}, {args.sweep_requests} requests per round, "
              f"{share / 60:.1f} min", flush=True)
        out.append(sweep_scenario(s, rates, sides, ctx, target, time.time() + share))
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


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def scenario_lines(sw: ScenarioSweep, names: list[str], cores: int, target: float, plot: Path) -> list[str]:
    s = sw.scenario
    base, other = names
    lines = [f"## {s.name}", "", f"{s.description}. Workload `{s.workload}`; SLO TTFT {s.slo_ttft_ms:g} ms, "
             f"TPOT {s.slo_tpot_ms:g} ms; {s.num_requests} requests per rate and layout in {s.rounds} ABBA rounds. "
             f"Ladder: {sw.stopped}.", "",
             "| rate (req/s) | " + " | ".join(f"{n} measured (predicted)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for g in sw.rungs:
        cells = [f"{_pct(g.runs[n].measured.slo_attainment)} ({_pct(attainment(g.predicted_records[n], s.slo_ttft_ms, s.slo_tpot_ms))})"
                 for n in names]
        lines.append(f"| {g.rate:g} | " + " | ".join(cells) + " |")
    meas = {n: max_rate(sw.curve(n), target) for n in names}
    pred = {n: max_rate(sw.curve(n, predicted=True), target) for n in names}
    rounds = min((len(g.runs[n].rounds) for g in sw.rungs for n in names), default=0)
    per_round = [ratio(max_rate(sw.round_curve(other, k), target), max_rate(sw.round_curve(base, k), target))
                 for k in range(rounds)]
    lines += ["", f"Highest rate with >= {100 * target:g}% of requests meeting both SLOs (a rate above the last "
              "one measured is not known):", "",
              "| layout | measured (req/s) | per core | predicted (req/s) | predicted vs measured |",
              "|---|---|---|---|---|"]
    top = max((g.rate for g in sw.rungs), default=None)
    for n in names:
        err = ratio(pred[n], meas[n])
        mark = " (top of the ladder: at least)" if meas[n] is not None and meas[n] == top else ""
        lines.append(f"| {n} | {_fmt(meas[n])}{mark} | {_fmt(None if meas[n] is None else meas[n] / cores)} | "
                     f"{_fmt(pred[n])} | {'-' if err is None else f'{100 * (err - 1):+.0f}%'} |")
    r = ratio(meas[other], meas[base])
    lines += ["", f"**{other} / {base}: {'-' if r is None else f'{r:.2f}x'}** (same cores, so per core too); "
              "per round: " + (", ".join("-" if x is None else f"{x:.2f}x" for x in per_round) or "-") + ".", "",
              "SLO scale (both SLOs multiplied): highest rate per layout", "",
              "| scale | " + " | ".join(names) + " | wins |", "|---|" + "---|" * (len(names) + 1)]
    for scale in SLO_SCALES:
        best = {n: max_rate(sw.curve(n, scale), target) for n in names}
        top = max((v for v in best.values() if v is not None), default=None)
        wins = "-" if top is None else ", ".join(n for n in names if best[n] == top)
        lines.append(f"| {scale:g} | " + " | ".join(_fmt(best[n]) for n in names) + f" | {wins} |")
    return lines + ["", f"![attainment vs rate and SLO scale]({plot.name})", ""]


def plot_sweep(sw: ScenarioSweep, names: list[str], target: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, n in enumerate(names):
        color = f"C{i}"
        for predicted, style in ((False, "-o"), (True, "--x")):
            c = sw.curve(n, predicted=predicted)
            left.plot(list(c), [100 * (v or 0) for v in c.values()], style, color=color,
                      label=f"{n} {'predicted' if predicted else 'measured'}")
            best = [max_rate(sw.curve(n, s, predicted), target) or 0 for s in SLO_SCALES]
            right.plot(SLO_SCALES, best, style, color=color, label=f"{n} {'predicted' if predicted else 'measured'}")
    left.axhline(100 * target, color="grey", lw=0.8)
    left.set(xlabel="rate (req/s)", ylabel="SLO attainment (%)", title=f"{sw.scenario.name}: attainment vs rate",
             ylim=(0, 105))
    right.set(xlabel="SLO scale (x TTFT and TPOT SLO)", ylabel=f"highest rate at >= {100 * target:g}% (req/s)",
              title="highest rate vs SLO scale", ylim=(0, None))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_sweep(out: Path, sweeps: list[ScenarioSweep], names: list[str], meta: dict, target: float) -> Path:
    cores = len(meta["cpus"])
    lines = [f"# Goodput sweep: {' vs '.join(names)} on the same cores", "",
             f"- model `{meta['model']}`; cores {meta['cpus']}; command `{meta['command']}` "
             f"({meta['wall_s'] / 60:.1f} min)",
             f"- goodput = the highest rate on the ladder with >= {100 * target:g}% of requests meeting both the "
             "TTFT and the TPOT SLO, below the first rate that misses; predicted = the planner's simulation "
             "(profile + probe calibration) of exactly the requests sent.", ""]
    data = []
    for sw in sweeps:
        plot = plot_sweep(sw, names, target, out / f"sweep-{sw.scenario.name}.png")
        lines += scenario_lines(sw, names, cores, target, plot)
        data.append({"scenario": sw.scenario.name, "stopped": sw.stopped,
                     "max_rate": {n: max_rate(sw.curve(n), target) for n in names},
                     "predicted_max_rate": {n: max_rate(sw.curve(n, predicted=True), target) for n in names},
                     "curves": {n: {str(k): v for k, v in sw.curve(n).items()} for n in names},
                     "predicted_curves": {n: {str(k): v for k, v in sw.curve(n, predicted=True).items()}
                                          for n in names},
                     "rungs": [{"rate": g.rate, "wall_s": g.wall_s,
                                "measured": {n: g.runs[n].measured.to_json() for n in names},
                                "rounds": {n: [x.to_json() for x in g.runs[n].rounds] for n in names}}
                               for g in sw.rungs]})
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "target": target, "scenarios": data}, indent=1) + "\n")
    path = out / "sweep.md"
    path.write_text("\n".join(lines) + "\n")
    return path
