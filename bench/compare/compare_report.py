"""The markdown report of ``bench compare``: headline ratios, planner vs
measured, idle TTFT with the transfer time it hid, and plots."""

from __future__ import annotations

from pathlib import Path

from bench.load.metrics import Summary, summarize
from bench.load.report import plot_latency_cdfs, plot_tpot_over_time, stats_row


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _err(pred: float | None, meas: float | None) -> str:
    if pred is None or meas is None or meas == 0:
        return "-"
    return f"{100 * (pred - meas) / meas:+.0f}%"


def headline_rows(base: Summary, other: Summary) -> list[tuple[str, float | None, float | None]]:
    """(metric, colocated, xPyD): the rows of the headline table."""
    return [
        ("goodput (req/s)", base.goodput, other.goodput),
        ("SLO attainment (%)", _pct(base.slo_attainment), _pct(other.slo_attainment)),
        ("p99 TPOT (ms)", base.tpot.p99, other.tpot.p99),
        ("mean TPOT (ms)", base.tpot.mean, other.tpot.mean),
        ("mean TTFT (ms)", base.ttft.mean, other.ttft.mean),
        ("p99 TTFT (ms)", base.ttft.p99, other.ttft.p99),
        ("throughput (req/s)", base.request_throughput, other.request_throughput),
        ("output tokens/s", base.output_token_throughput, other.output_token_throughput),
        ("failed requests", float(base.failed), float(other.failed)),
    ]


def round_ratios(base, other, metric) -> str:
    """The xPyD/colocated ratio of ``metric(summary)`` in each round, e.g. "2.1x, 1.8x"."""
    pairs = list(zip(base.rounds, other.rounds))
    if len(pairs) < 2:
        return "-"
    return ", ".join(_ratio(metric(b), metric(a)) for a, b in pairs)


ROUND_METRICS = {
    "goodput (req/s)": lambda m: m.goodput,
    "p99 TPOT (ms)": lambda m: m.tpot.p99,
    "mean TPOT (ms)": lambda m: m.tpot.mean,
    "mean TTFT (ms)": lambda m: m.ttft.mean,
}
TPOT_SLOS_MS = (50, 75, 100, 150, 200, 300)


def slo_sweep(base, other) -> list[str]:
    """Goodput of both layouts for a range of TPOT SLOs (the scenario's TTFT SLO kept)."""
    s = base.scenario
    lines = [f"| TPOT SLO (ms) | colocated goodput (req/s) | {other.layout} | ratio |", "|---|---|---|---|"]
    for slo in sorted(set(TPOT_SLOS_MS) | {s.slo_tpot_ms}):
        a = summarize(base.records, base.measured.duration_s, s.slo_ttft_ms, slo).goodput
        b = summarize(other.records, other.measured.duration_s, s.slo_ttft_ms, slo).goodput
        mark = " (scenario's SLO)" if slo == s.slo_tpot_ms else ""
        lines.append(f"| {slo:g}{mark} | {_num(a, 3)} | {_num(b, 3)} | {_ratio(b, a)} |")
    return lines


def _pct(v: float | None) -> float | None:
    return None if v is None else 100 * v


def wire_ms(nbytes: float | None, bandwidth: float | None) -> float | None:
    """What the KV would add to TTFT if it were sent only after the prefill."""
    if not nbytes or not bandwidth:
        return None
    return 1000 * nbytes / bandwidth


def write_report(out: Path, runs: list, meta: dict) -> Path:
    by = {(r.layout, r.scenario.name): r for r in runs}
    xname = meta["layout"]
    scenarios = list(dict.fromkeys(r.scenario.name for r in runs))
    lines = [f"# Colocated vs {xname}: measured on the same cores", ""]
    lines += [
        f"- model: `{meta['model']}`; cores {meta['cpus']}; torch threads: colocated "
        f"{meta['threads']['colocated']} in one engine, {xname} {meta['threads'][xname]} per instance",
        f"- command: `{meta['command']}` ({meta['wall_s'] / 60:.1f} min)",
        "- load average (1 min) before/after each run is listed per run: other work on the machine shows there.",
        "",
    ]
    lines += [
        "## Headline",
        "",
        "Each scenario ran in rounds sent to the layouts in turn (ABBA); the table pools "
        "the rounds, the last column gives the ratio in each round on its own.",
        "",
        f"| scenario | metric | colocated | {xname} | {xname} / colocated | per round |",
        "|---|---|---|---|---|---|",
    ]
    for name in scenarios:
        base, other = by.get(("colocated", name)), by.get((xname, name))
        if base is None or other is None or base.scenario.idle:
            continue
        for metric, a, b in headline_rows(base.measured, other.measured):
            per_round = round_ratios(base, other, ROUND_METRICS[metric]) if metric in ROUND_METRICS else "-"
            lines.append(
                f"| {name} | {metric} | {_num(a, 3 if 'req/s' in metric else 1)} | "
                f"{_num(b, 3 if 'req/s' in metric else 1)} | {_ratio(b, a)} | {per_round} |"
            )
    for name in scenarios:
        base, other = by.get(("colocated", name)), by.get((xname, name))
        if base is None or other is None or base.scenario.idle or base.scenario.slo_tpot_ms is None:
            continue
        lines += ["", f"### Goodput vs TPOT SLO: {name}", "", *slo_sweep(base, other)]
    lines += [
        "",
        "## Planner vs measured (means)",
        "",
        "| scenario | layout | TTFT predicted | TTFT measured | error | TPOT predicted | TPOT measured "
        "| error | goodput predicted | goodput measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        p, m = r.predicted, r.measured
        if p is None:
            continue
        lines.append(
            f"| {r.scenario.name} | {r.layout} | {_num(p.ttft.mean)} | {_num(m.ttft.mean)} | "
            f"{_err(p.ttft.mean, m.ttft.mean)} | {_num(p.tpot.mean)} | {_num(m.tpot.mean)} | "
            f"{_err(p.tpot.mean, m.tpot.mean)} | {_num(p.goodput, 3)} | {_num(m.goodput, 3)} |"
        )
    calib = {r.layout: r.calibration for r in runs if r.calibration}
    if calib:
        lines += [
            "",
            "Predictions use the profile plus each live cluster's fixed costs, measured with tiny "
            "probe requests (one at a time, then four at a time, then 1024-token prompts): "
            + "; ".join(
                f"{k} +{v['step_ms']:.1f} ms/step, +{v.get('seq_ms', 0.0):.1f} ms per sequence in a step, "
                f"+{v['request_ms']:.1f} ms/request, prefill x{v.get('prefill_scale', 1.0):.2f} of the profile's "
                "(1024-token probes)"
                for k, v in calib.items()
            )
            + ".",
        ]
    lines += _idle_section(runs, meta)
    lines += _engine_section(runs)
    lines += ["", "## Runs", ""]
    for name in scenarios:
        group = [r for r in runs if r.scenario.name == name]
        s = group[0].scenario
        arrivals = f"Poisson {s.rate:g} req/s" if s.rate else f"concurrency {s.concurrency}"
        lines += [
            f"### {name}",
            "",
            f"{s.description}. Workload `{s.workload}`, {s.num_requests} requests, "
            f"{arrivals}; SLO TTFT {_num(s.slo_ttft_ms, 0)} ms, TPOT {_num(s.slo_tpot_ms, 0)} ms.",
            "",
            "| layout | done/failed | TTFT ms mean/p50/p90/p99 | TPOT ms mean/p50/p90/p99 | ITL p99 | "
            "E2E mean | load avg |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in group:
            m = r.measured
            lines.append(
                f"| {r.layout} | {m.completed}/{m.failed} | {stats_row(m.ttft)} | {stats_row(m.tpot)} | "
                f"{_num(m.itl.p99)} | {_num(m.e2e.mean)} | {r.loadavg[0]:.1f} -> {r.loadavg[1]:.1f} |"
            )
        runs_by_layout = {r.layout: r.records for r in group}
        cdf = plot_latency_cdfs(runs_by_layout, out / f"{name}-latency_cdf.png")
        tpot = plot_tpot_over_time(runs_by_layout, out / f"{name}-tpot_over_time.png")
        lines += ["", f"![latency CDFs]({cdf.name}) ![TPOT over time]({tpot.name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _idle_section(runs: list, meta: dict) -> list[str]:
    idle = [r for r in runs if r.scenario.idle]
    if not idle:
        return []
    base = next((r for r in idle if r.layout == "colocated"), None)
    transfer = meta.get("transfer", {})
    bandwidth = transfer.get("bandwidth")
    lines = [
        "",
        "## Idle TTFT, 2048-token prompt",
        "",
        "| layout | TTFT mean (ms) | predicted | vs colocated | KV per request (MB) | wire time if sent "
        "after prefill (ms) | P accept-to-ack (ms) | exposed: P prefill end to D ack (ms) | wire time hidden |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in idle:
        t = max(r.transfer.values(), key=lambda v: v["span_s"]) if r.transfer else None
        wire = wire_ms(t["bytes"] if t else None, bandwidth)
        exposed = 1000 * t["exposed_s"] if t and "exposed_s" in t else None
        lines.append(
            f"| {r.layout} | {_num(r.measured.ttft.mean)} | {_num(r.predicted.ttft.mean if r.predicted else None)} "
            f"| {_ratio(r.measured.ttft.mean, base.measured.ttft.mean if base else None)} "
            f"| {_num(t['bytes'] / 1e6 if t else None, 2)} | {_num(wire)} "
            f"| {_num(1000 * t['span_s'] if t else None)} | {_num(exposed)} | {hidden_share(wire, exposed)} |"
        )
    tails = transfer.get("tail_2k_s") or {}
    if bandwidth:
        lines += [
            "",
            f"KV bandwidth {bandwidth / 1e9:.2f} GB/s ({transfer.get('source')}). Pushed layer by layer, "
            "only the last layer's share follows the prefill: the planner puts the exposed tail of a 2048-token "
            "prompt at "
            + ", ".join(f"{1000 * v:.1f} ms (P with {k} thread{'s' if int(k) > 1 else ''})" for k, v in tails.items())
            + ". The prefill server measures the exposed part itself (histogram "
            "`pdserve_transfer_exposed_seconds`: from its last layer computed and first token sampled to the "
            "decode server's ack); the hidden share is the wire time less that.",
        ]
    return lines


def hidden_share(wire: float | None, exposed: float | None) -> str:
    """How much of the wire time the layer-wise push overlapped with compute."""
    if wire is None or exposed is None or wire <= 0:
        return "-"
    hidden = max(0.0, wire - exposed)
    return f"{hidden:.1f} ms ({100 * hidden / wire:.0f}%)"


def _engine_section(runs: list) -> list[str]:
    """What each engine did during each scenario, from its own step counters."""
    rows = [(r, name, e) for r in runs for name, e in sorted(r.engines.items())]
    if not rows:
        return []
    lines = [
        "",
        "## Engine steps (each server's own counters over the scenario, one warmup request per round included)",
        "",
        "| scenario | layout | server | prefill steps, mean ms | decode steps, mean ms | mixed steps, mean ms "
        "| preemptions |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, name, e in rows:

        def cell(kind, e=e):
            return f"{e[kind + '_steps']:.0f}, {_num(e[kind + '_step_ms'])}" if e[kind + "_steps"] else "-"

        lines.append(
            f"| {r.scenario.name} | {r.layout} | {name} | {cell('prefill')} | {cell('decode')} | "
            f"{cell('mixed')} | {e['preemptions']:.0f} |"
        )
    return lines
