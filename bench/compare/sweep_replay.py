"""Re-simulate a saved goodput sweep with the planner as it is now.

    python -m bench.compare.sweep_replay runs/sweep [--profile FILE] [--steps]

``pdserve bench compare --sweep`` keeps in ``sweep.json`` every request it
sent (lengths, send times, token times), the probes each layout was
calibrated with, the engine settings and the profile's path. This rebuilds
each layout from the profile, calibrates it again from the saved probes
(``compare_run.calibrate``), simulates exactly the requests of every rung and
prints measured vs predicted attainment and crossing, so a change to the
cost model or the simulator can be judged against real runs in seconds,
without a live cluster. Run on an unchanged planner it reproduces the
report's predictions.

``--steps`` adds, per rate, each server's engine steps by kind (prefill,
decode, mixed: count and mean time) from its counters against the
simulation's: whether a miss comes from slower steps or from different
batching. The measured counts include each round's warm-up request.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from bench.compare.compare_run import calibrate_from_probes, simulation
from bench.compare.compare_sweep import fmt_num, fmt_pct
from bench.compare.scenarios import Scenario
from bench.load.metrics import RequestRecord
from bench.load.workload import Workload
from bench.plan.costmodel import Overheads
from bench.plan.plan import Candidate, EngineSettings, build_layout
from bench.plan.profile import Profile
from bench.plan.sim_instances import STEP_KINDS
from bench.plan.sweep import attainment, crossing


@dataclass
class Replayed:
    scenario: str
    measured: dict[str, dict[float, float | None]]  # layout -> rate -> attainment
    predicted: dict[str, dict[float, float | None]]
    target: float
    # rate -> layout -> server -> kind -> ((steps, mean ms) measured, (steps, mean ms) simulated)
    steps: dict[float, dict[str, dict[str, dict[str, tuple]]]] = field(default_factory=dict)

    def crossings(self, predicted: bool) -> dict[str, float | None]:
        curves = self.predicted if predicted else self.measured
        return {name: crossing(curve, self.target) for name, curve in curves.items()}


def record(data: dict) -> RequestRecord:
    names = {f.name for f in fields(RequestRecord)}
    return RequestRecord(**{k: v for k, v in data.items() if k in names})


def layouts(meta: dict, profile: Profile, calibration: dict | None = None) -> dict:
    """Each layout of the sweep, built from the profile and calibrated from its saved probes:
    ``calibration``'s (a scenario's own), else the ones taken at launch."""
    settings = EngineSettings(**meta["settings"])
    calibration = calibration or meta["calibration"]
    out = {}
    for name, cand in meta["layouts"].items():
        probes = {k: [record(r) for r in v] for k, v in calibration[name]["probes"].items()}
        out[name], _ = calibrate_from_probes(build_layout(Candidate(**cand), profile, settings, Overheads()), probes)
    return out


def replay(folder: Path, profile_path: str | None = None) -> list[Replayed]:
    data = json.loads((folder / "sweep.json").read_text())
    meta = data["meta"]
    missing = [k for k in ("settings", "layouts", "profile") if k not in meta]
    if missing:
        raise ValueError(
            f"{folder}/sweep.json has no {', '.join(missing)}: written by an older pdserve, rerun the sweep"
        )
    profile = Profile.load(profile_path or meta["profile"])
    out = []
    for sc in data["scenarios"]:
        built = layouts(meta, profile, sc.get("calibration"))
        measured = {name: {float(rate): a for rate, a in curve.items()} for name, curve in sc["curves"].items()}
        predicted = {name: {} for name in built}
        steps = {}
        for rung in sc["rungs"]:
            sent = next(iter(rung["requests"].values()))
            for name, layout in built.items():
                recs = [record(r) for r in rung["requests"].get(name, sent)]
                # The simulation takes lengths and send times from the records; of the scenario only
                # that it is open-loop (not idle).
                at = Scenario(sc["scenario"], "replayed", Workload.single("1", "1"), len(recs), rate=rung["rate"])
                result = simulation(layout, at, recs)
                predicted[name][rung["rate"]] = attainment(result.records, sc["slo_ttft_ms"], sc["slo_tpot_ms"])
                if name in rung.get("engines", {}):
                    steps.setdefault(rung["rate"], {})[name] = step_pairs(rung["engines"][name], result.steps)
        out.append(Replayed(sc["scenario"], measured, predicted, data["target"], steps))
    return out


def step_pairs(engines: dict[str, dict], simulated: dict[str, dict[str, tuple[int, float]]]) -> dict:
    """Each server's steps by kind, measured (its counters over the rung) against simulated.

    The simulator names instances C0/P0/D0 in the order the generated config
    names its servers c0/p0/d0 (``scenarios.cluster_config``).
    """
    out = {}
    for server, counters in engines.items():
        sim = simulated.get(server.upper(), {})
        out[server] = {}
        for kind in STEP_KINDS:
            n, seconds = sim.get(kind, (0, 0.0))
            measured = (counters.get(f"{kind}_steps") or 0, counters.get(f"{kind}_step_ms"))
            if measured[0] or n:
                out[server][kind] = (measured, (n, 1000 * seconds / n if n else None))
    return out


def format_replay(results: list[Replayed], show_steps: bool = False) -> str:
    lines = []
    for r in results:
        names = list(r.predicted)
        lines += [
            f"## {r.scenario}",
            "",
            "| rate (req/s) | " + " | ".join(f"{n} measured (predicted)" for n in names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for rate in sorted(next(iter(r.predicted.values()))):
            lines.append(
                f"| {rate:g} | "
                + " | ".join(
                    f"{fmt_pct(r.measured[n].get(rate)) if rate in r.measured[n] else 'not run'} "
                    f"({fmt_pct(r.predicted[n][rate])})"
                    for n in names
                )
                + " |"
            )
        meas, pred = r.crossings(False), r.crossings(True)
        lines += [
            "",
            "| layout | measured crossing | predicted crossing | predicted vs measured |",
            "|---|---|---|---|",
        ]
        for n in names:
            err = "-" if not meas[n] or pred[n] is None else f"{100 * (pred[n] / meas[n] - 1):+.0f}%"
            lines.append(f"| {n} | {fmt_num(meas[n])} | {fmt_num(pred[n])} | {err} |")
        lines.append("")
        if show_steps and r.steps:
            lines += [
                f"Engine steps, {r.scenario}: count and mean ms by kind, measured (simulated)",
                "",
                "| rate (req/s) | layout | server | " + " | ".join(STEP_KINDS) + " |",
                "|---|---|---|" + "---|" * len(STEP_KINDS),
            ]
            for rate, by_layout in sorted(r.steps.items()):
                for name, servers in by_layout.items():
                    for server, kinds in servers.items():
                        cells = [_steps_cell(kinds[k]) if k in kinds else "-" for k in STEP_KINDS]
                        lines.append(f"| {rate:g} | {name} | {server} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def _steps_cell(pair: tuple) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}" if v < 100 else f"{v:.0f}"

    (n, mean), (sim_n, sim_mean) = pair
    return f"{n:.0f} x {ms(mean)} ({sim_n} x {ms(sim_mean)})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare.sweep_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a sweep's --out folder (with sweep.json)")
    p.add_argument("--profile", metavar="FILE", help="profile to simulate with (default: the one the sweep used)")
    p.add_argument(
        "--steps",
        action="store_true",
        help="also each server's engine steps by kind per rate, measured vs simulated: where the cost model is off",
    )
    args = p.parse_args(argv)
    try:
        results = replay(Path(args.folder), args.profile)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_replay(results, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
