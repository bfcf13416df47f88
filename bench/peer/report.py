"""bench.peer's results: one sample per (workload, dtype, system, round), their medians, the pdserve / vLLM
ratios of each pair of systems, and the markdown tables.

Every ratio is oriented so that above 1 means pdserve is better: output tok/s and goodput are
pdserve / vLLM, latencies (TTFT, TPOT, ITL) are vLLM / pdserve.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from bench.load.metrics import Summary

# The systems, in the order a round starts them (reversed on odd rounds), and each pdserve system's peer.
VLLM_COLOCATED = "vllm-colocated"
VLLM_PD = "vllm-pd"
PDSERVE_COLOCATED = "pdserve-colocated"
PDSERVE_1P1D = "pdserve-1p1d"
SYSTEMS = (VLLM_COLOCATED, VLLM_PD, PDSERVE_COLOCATED, PDSERVE_1P1D)
PAIRS = ((PDSERVE_COLOCATED, VLLM_COLOCATED), (PDSERVE_1P1D, VLLM_PD))
LABELS = {
    VLLM_COLOCATED: "vLLM colocated",
    VLLM_PD: "vLLM P/D split (NIXL, vllm-router)",
    PDSERVE_COLOCATED: "pdserve colocated",
    PDSERVE_1P1D: "pdserve 1P1D",
}
# metric -> (column header, higher is better)
METRICS = {
    "output_tok_s": ("output tok/s", True),
    "ttft_p50_ms": ("TTFT p50 ms", False),
    "tpot_p50_ms": ("TPOT p50 ms", False),
    "itl_p50_ms": ("ITL p50 ms", False),
    "goodput_req_s": ("goodput req/s", True),
}
GOODPUT_ROW = "all workloads: goodput at SLO"


@dataclass(frozen=True)
class Workload:
    """One row of the issue's table: ``concurrency`` streams, ``requests`` in all, fixed lengths."""

    concurrency: int
    requests: int
    prompt: int
    output: int

    @property
    def name(self) -> str:
        return f"{self.concurrency}x{self.requests} {self.prompt}/{self.output}"


WORKLOADS = (Workload(1, 5, 128, 128), Workload(8, 32, 128, 128), Workload(2, 8, 1024, 64), Workload(4, 16, 1024, 128))


@dataclass(frozen=True)
class Sample:
    """One system's run of one workload in one round."""

    workload: str
    dtype: str
    system: str
    round: int
    output_tok_s: float
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None
    itl_p50_ms: float | None
    goodput_req_s: float | None
    good: int
    completed: int
    failed: int
    duration_s: float

    @classmethod
    def of(cls, workload: str, dtype: str, system: str, round_index: int, summary: Summary) -> Sample:
        return cls(
            workload,
            dtype,
            system,
            round_index,
            summary.output_token_throughput,
            summary.ttft.p50,
            summary.tpot.p50,
            summary.itl.p50,
            summary.goodput,
            summary.good_requests or 0,
            summary.completed,
            summary.failed,
            summary.duration_s,
        )

    def to_json(self) -> dict:
        return asdict(self)


def goodput_samples(samples: list[Sample]) -> list[Sample]:
    """Per (dtype, system, round): every workload's requests that met the SLO over their total time."""
    groups: dict[tuple[str, str, int], list[Sample]] = {}
    for s in samples:
        if s.workload != GOODPUT_ROW:
            groups.setdefault((s.dtype, s.system, s.round), []).append(s)
    out = []
    for (dtype, system, round_index), group in groups.items():
        seconds = sum(s.duration_s for s in group)
        good = sum(s.good for s in group)
        out.append(
            Sample(
                GOODPUT_ROW,
                dtype,
                system,
                round_index,
                sum(s.output_tok_s * s.duration_s for s in group) / seconds if seconds > 0 else 0.0,
                None,
                None,
                None,
                good / seconds if seconds > 0 else 0.0,
                good,
                sum(s.completed for s in group),
                sum(s.failed for s in group),
                seconds,
            )
        )
    return out


@dataclass(frozen=True)
class Cell:
    """A metric's median over rounds and its range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Cell | None:
        return cls(statistics.median(values), min(values), max(values)) if values else None

    def text(self) -> str:
        if self.low == self.high:
            return f"{self.median:.1f}"
        return f"{self.median:.1f} ({self.low:.1f}-{self.high:.1f})"

    def to_json(self) -> dict:
        return asdict(self)


def cells(samples: list[Sample], workload: str, dtype: str, system: str) -> dict[str, Cell | None]:
    """Each metric's cell for one system on one row (None where no round measured it)."""
    mine = [s for s in samples if (s.workload, s.dtype, s.system) == (workload, dtype, system)]
    out: dict[str, Cell | None] = {}
    for metric in METRICS:
        values = [getattr(s, metric) for s in mine if getattr(s, metric) is not None]
        out[metric] = Cell.of(values)
    return out


def ratio(mine: Cell | None, theirs: Cell | None, higher_is_better: bool) -> float | None:
    """Medians, oriented so that above 1 means ``mine`` (pdserve) is better; None without both."""
    if mine is None or theirs is None:
        return None
    num, den = (mine.median, theirs.median) if higher_is_better else (theirs.median, mine.median)
    return num / den if den > 0 else None


def rows(samples: list[Sample], systems: list[str], dtypes: list[str], workloads: list[str]) -> list[dict]:
    """One entry per (workload, dtype): each system's cells and each measured pair's ratios."""
    out = []
    for workload in [*workloads, GOODPUT_ROW]:
        for dtype in dtypes:
            per_system = {system: cells(samples, workload, dtype, system) for system in systems}
            ratios = {}
            for mine, theirs in PAIRS:
                if mine in per_system and theirs in per_system:
                    ratios[f"{mine}/{theirs}"] = {
                        metric: ratio(per_system[mine][metric], per_system[theirs][metric], higher)
                        for metric, (_, higher) in METRICS.items()
                    }
            out.append({"workload": workload, "dtype": dtype, "systems": per_system, "ratios": ratios})
    return out


def _show(cell: Cell | None) -> str:
    return "-" if cell is None else cell.text()


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_tables(table_rows: list[dict], failures: dict[str, int] | None = None) -> str:
    """Markdown: every system's medians (ranges over rounds); then, where a pair was measured, pdserve / vLLM."""
    head = [title for title, _ in METRICS.values()]
    lines = ["| workload | dtype | system | " + " | ".join(head) + " |", "|---" * (3 + len(head)) + "|"]
    for row in table_rows:
        for system, metric_cells in row["systems"].items():
            if all(c is None for c in metric_cells.values()):
                continue
            values = " | ".join(_show(metric_cells[m]) for m in METRICS)
            lines.append(f"| {row['workload']} | {row['dtype']} | {LABELS[system]} | {values} |")
    pairs = []
    for row in table_rows:
        for pair, values in row["ratios"].items():
            if all(v is None for v in values.values()):
                continue
            mine, theirs = pair.split("/")
            shown = " | ".join(_times(values[m]) for m in METRICS)
            pairs.append(f"| {row['workload']} | {row['dtype']} | {LABELS[mine]} / {LABELS[theirs]} | {shown} |")
    if pairs:
        lines += ["", "pdserve / vLLM (above 1: pdserve better; latencies as vLLM / pdserve):", ""]
        lines += ["| workload | dtype | pair | " + " | ".join(head) + " |", "|---" * (3 + len(head)) + "|", *pairs]
    for system, count in (failures or {}).items():
        if count:
            lines.append(f"\n{LABELS[system]}: {count} requests failed (in the JSON by reason)")
    return "\n".join(lines)


def rows_to_json(table_rows: list[dict]) -> list[dict]:
    return [
        {
            "workload": row["workload"],
            "dtype": row["dtype"],
            "systems": {
                system: {m: (c.to_json() if c is not None else None) for m, c in metric_cells.items()}
                for system, metric_cells in row["systems"].items()
            },
            "ratios": row["ratios"],
        }
        for row in table_rows
    ]
