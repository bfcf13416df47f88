"""Goodput as the highest request rate that still meets the SLO.

A layout's goodput is the highest arrival rate at which at least
``target`` of the requests meet both the TTFT and the TPOT SLO. The search
here is a ladder: rates grow by a constant factor and every layout is
measured (or simulated) at the same rates, with the same prompts and
arrival pattern. The highest rate counted is the last one met *before* the
first miss, so a lucky pass above a miss does not count (noise at low
attainment is what this measure avoids).

Pure functions on ``{rate: attainment}`` curves and request records; the
driver that measures live clusters is ``bench/compare/compare_sweep.py``.
"""

from __future__ import annotations

from bench.load.metrics import RequestRecord, summarize
from bench.load.workload import Workload, poisson_arrivals
from bench.plan.simulate import Layout, simulate

SLO_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0)


def ladder(start: float, factor: float, count: int) -> list[float]:
    """``count`` rates from ``start``, each ``factor`` times the one before."""
    if start <= 0 or factor <= 1 or count < 1:
        raise ValueError(f"bad ladder: start {start} (> 0), factor {factor} (> 1), count {count} (>= 1)")
    return [round(start * factor**i, 6) for i in range(count)]


def max_rate(curve: dict[float, float | None], target: float) -> float | None:
    """The highest rate met (attainment >= target) below the lowest rate missed;
    None when the lowest rate already misses. A rate with no attainment (no
    request sent) counts as missed."""
    best = None
    for rate in sorted(curve):
        value = curve[rate]
        if value is None or value < target:
            break
        best = rate
    return best


def crossing(curve: dict[float, float | None], target: float) -> float | None:
    """Where attainment falls through ``target``: linear between the highest rate met
    (``max_rate``) and the first rate missed above it. None when the lowest rate
    misses or no rate misses (the crossing is above the ladder)."""
    met = max_rate(curve, target)
    above = sorted(r for r in curve if met is not None and r > met)
    if met is None or not above:
        return None
    lo, hi = curve[met], curve[above[0]] or 0.0
    return met + (lo - target) / (lo - hi) * (above[0] - met)


def attainment(
    records: list[RequestRecord], slo_ttft_ms: float | None, slo_tpot_ms: float | None, scale: float = 1.0
) -> float | None:
    """Share of requests meeting both SLOs, each multiplied by ``scale`` (failed requests miss)."""

    def mul(v):
        return None if v is None else v * scale

    return summarize(records, None, mul(slo_ttft_ms), mul(slo_tpot_ms)).slo_attainment


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def predicted_curve(
    layout: Layout,
    workload: Workload,
    rates: list[float],
    num_requests: int,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    seed: int = 0,
) -> dict[float, float]:
    """The planner's attainment at each rate: the simulator on the same requests at
    every rate (Poisson arrivals from one seed, so only their spacing changes)."""
    specs = workload.specs(num_requests, seed)
    out = {}
    for rate in rates:
        records = simulate(layout, specs, poisson_arrivals(rate, num_requests, seed)).records
        out[rate] = attainment(records, slo_ttft_ms, slo_tpot_ms)
    return out
