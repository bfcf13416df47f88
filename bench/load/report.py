"""Text tables, JSON results and PNG plots of load-test runs.

Plots use matplotlib's object API (``Figure``), not pyplot, so nothing
global is touched and no display is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.load.metrics import RequestRecord, Stats, Summary, TurnStats


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summary: Summary, title: str = "Serving benchmark") -> str:
    """A fixed-width table like vLLM's ``benchmark_serving`` prints."""
    width = 56
    lines = [f"{f' {title} ':=^{width}}"]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:<40}{value:>16}")

    row("Requests completed:", str(summary.completed))
    row("Requests failed:", str(summary.failed))
    row("Duration (s):", _fmt(summary.duration_s))
    row("Request throughput (req/s):", _fmt(summary.request_throughput, 3))
    row("Input token throughput (tok/s):", _fmt(summary.input_token_throughput, 1))
    row("Output token throughput (tok/s):", _fmt(summary.output_token_throughput, 1))
    row("Total token throughput (tok/s):", _fmt(summary.total_token_throughput, 1))
    if summary.goodput is not None:
        slo = []
        if summary.slo_ttft_ms is not None:
            slo.append(f"TTFT<={summary.slo_ttft_ms:g}ms")
        if summary.slo_tpot_ms is not None:
            slo.append(f"TPOT<={summary.slo_tpot_ms:g}ms")
        row("Goodput (req/s):", _fmt(summary.goodput, 3))
        lines.append(f"  requests meeting {' and '.join(slo)}")
        row("SLO attainment (%):", _fmt(100 * summary.slo_attainment, 1))
    for name, stats in (
        ("TTFT", summary.ttft),
        ("TPOT", summary.tpot),
        ("ITL", summary.itl),
        ("E2E latency", summary.e2e),
    ):
        lines.append(f"{f' {name} (ms) ':-^{width}}")
        for label in ("mean", "p50", "p90", "p99", "max"):
            row(f"{label}:", _fmt(getattr(stats, label)))
    for error, count in sorted(summary.errors.items()):
        row(f"error: {error}"[:39], str(count))
    lines.append("=" * width)
    return "\n".join(lines)


def format_turns(turns: list[TurnStats]) -> str:
    """Per turn of a multi-turn workload: TTFT p50/p99 and the input tokens per request, the share the
    server found cached, and the share computed (input - cached; usage, so as the server counts)."""
    lines = [
        f"{'turn':>4} {'ok':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'input/req':>9} "
        f"{'cached/req':>10} {'computed':>9}",
    ]
    for t in turns:
        input_per, cached_per = (
            _fmt(n / t.reported if t.reported else None, 1) for n in (t.input_tokens, t.cached_tokens)
        )
        share = "-" if t.computed_share is None else f"{100 * t.computed_share:.1f}%"
        lines.append(
            f"{t.turn:>4} {t.completed:>4} {_fmt(t.ttft.p50, 1):>9} {_fmt(t.ttft.p99, 1):>9} "
            f"{_fmt(t.tpot.p50, 1):>9} {input_per:>9} {cached_per:>10} {share:>9}"
        )
    return "Per turn (ms; tokens from the server's usage; computed = input - cached):\n" + "\n".join(lines)


def prompt_length_mismatches(records: list[RequestRecord]) -> int:
    """Completed requests whose server-counted prompt differs from ours."""
    return sum(
        1 for r in records if r.ok and r.server_prompt_tokens is not None and r.server_prompt_tokens != r.prompt_len
    )


def write_json(
    path: str | Path, config: dict, summary: Summary, records: list[RequestRecord], extra: dict | None = None
) -> None:
    """``extra``: more top-level keys (before the requests)."""
    data = {
        "config": config,
        "summary": summary.to_json(),
        **(extra or {}),
        "requests": [r.to_json() for r in records],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdfs(runs: dict[str, list[RequestRecord]], path: str | Path) -> Path:
    """One PNG with the CDFs of TTFT, TPOT, ITL and E2E, one line per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    metrics = (
        ("TTFT", lambda r: [r.ttft] if r.ttft is not None else []),
        ("TPOT", lambda r: [r.tpot] if r.tpot is not None else []),
        ("ITL", lambda r: r.itls),
        ("E2E latency", lambda r: [r.e2e] if r.e2e is not None else []),
    )
    for ax, (name, get) in zip(axes, metrics):
        for label, records in runs.items():
            _cdf(ax, [1000 * v for r in records if r.ok for v in get(r)], label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize="small")
    fig.suptitle("Latency CDFs")
    return _save(fig, path)


def plot_tpot_over_time(runs: dict[str, list[RequestRecord]], path: str | Path) -> Path:
    """TPOT of each request against the time its first token arrived."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.subplots()
    for label, records in runs.items():
        points = sorted((r.token_times[0], 1000 * r.tpot) for r in records if r.tpot is not None)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, ".", alpha=0.7, label=label)
    ax.set_xlabel("first token time (s since start)")
    ax.set_ylabel("TPOT (ms)")
    ax.grid(True, alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize="small")
    ax.set_title("TPOT over time")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def stats_row(stats: Stats) -> str:
    """``mean / p50 / p90 / p99`` in ms, for markdown tables."""
    return " / ".join(_fmt(v, 1) for v in (stats.mean, stats.p50, stats.p90, stats.p99))
