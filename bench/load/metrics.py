"""Latency and throughput metrics of a load test, from per-request timings.

Both the load client and the simulator produce :class:`RequestRecord` values,
so measured and predicted runs are summarised by the same code.

Definitions (the ones vLLM's and SGLang's serving benchmarks use):

* TTFT: first token arrival - request start.
* E2E: end of the response - request start.
* TPOT: (end - first token arrival) / (output tokens - 1), as vLLM's
  benchmark computes it (robust when a server sends several tokens in one
  chunk); undefined for a one-token answer.
* ITL: the gap between two consecutive token events (SSE chunks carrying
  text) of one request; every gap of every request is one sample.
* Percentiles: numpy's default linear interpolation between closest ranks,
  so p50 of [1, 2, 3, 4] is 2.5.
* Throughput: completed requests (or tokens) / run duration, where the
  duration is the wall time of the measured run (first start to last end
  unless the caller gives it).
* Goodput: completed requests per second whose TTFT and TPOT both meet the
  SLOs given; a one-token answer has no TPOT and meets any TPOT SLO.

Times are seconds on one monotonic clock; reported latencies are milliseconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
_SLACK = 1e-9


@dataclass
class RequestRecord:
    """What happened to one request. ``token_times`` are absolute times."""

    index: int
    prompt_len: int
    max_tokens: int
    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    ok: bool = False
    error: str | None = None
    server_prompt_tokens: int | None = None
    request_id: str | None = None  # the router's X-Request-Id (joins the servers' timelines)
    turn: int | None = None  # the turn of its conversation (multi-turn workloads), from 0
    cached_tokens: int | None = None  # prompt tokens the server found cached (usage), when it says

    @property
    def ttft(self) -> float | None:
        if not self.ok or not self.token_times:
            return None
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.ok else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or not self.token_times:
            return None
        return (self.end - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        if not self.ok:
            return []
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    def meets(self, slo_ttft: float | None, slo_tpot: float | None) -> bool:
        """True when the request completed within both SLOs (seconds).

        Exactly at the SLO meets it (1 ns slack absorbs float rounding).
        """
        if not self.ok or self.ttft is None:
            return False
        if slo_ttft is not None and self.ttft > slo_ttft + _SLACK:
            return False
        tpot = self.tpot
        return slo_tpot is None or tpot is None or tpot <= slo_tpot + _SLACK

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return data


@dataclass(frozen=True)
class Stats:
    """Distribution of one latency, in milliseconds."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        if not seconds:
            return cls(0, None, None, None, None, None)
        ms = np.asarray(seconds, dtype=float) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(len(ms), float(ms.mean()), p50, p90, p99, float(ms.max()))


@dataclass(frozen=True)
class Summary:
    """Aggregate of one run. Latencies in ms, throughputs per second."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    good_requests: int | None
    goodput: float | None
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    errors: dict[str, int]

    @property
    def slo_attainment(self) -> float | None:
        if self.good_requests is None or self.num_requests == 0:
            return None
        return self.good_requests / self.num_requests

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["slo_attainment"] = self.slo_attainment
        return data


def run_duration(records: list[RequestRecord]) -> float:
    """First start to last end over all records (0 when there are none)."""
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


def summarize(
    records: list[RequestRecord],
    duration_s: float | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> Summary:
    """Aggregates records; ``duration_s`` defaults to :func:`run_duration`."""
    if duration_s is None:
        duration_s = run_duration(records)
    done = [r for r in records if r.ok]
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error or "unknown error"
            errors[key] = errors.get(key, 0) + 1
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = None
    if has_slo:
        ttft_s = None if slo_ttft_ms is None else slo_ttft_ms / 1000.0
        tpot_s = None if slo_tpot_ms is None else slo_tpot_ms / 1000.0
        good = sum(1 for r in done if r.meets(ttft_s, tpot_s))
    return Summary(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        request_throughput=per_s(len(done)),
        input_token_throughput=per_s(input_tokens),
        output_token_throughput=per_s(output_tokens),
        total_token_throughput=per_s(input_tokens + output_tokens),
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        good_requests=good,
        goodput=None if good is None else per_s(good),
        ttft=Stats.of([r.ttft for r in done if r.ttft is not None]),
        tpot=Stats.of([r.tpot for r in done if r.tpot is not None]),
        itl=Stats.of([gap for r in done for gap in r.itls]),
        e2e=Stats.of([r.e2e for r in done if r.e2e is not None]),
        errors=errors,
    )


@dataclass(frozen=True)
class TurnStats:
    """The completed requests of one turn index of a multi-turn workload. Token counts are the
    server's (usage), summed over the requests that reported them (``reported``)."""

    turn: int
    completed: int
    failed: int
    ttft: Stats
    tpot: Stats
    e2e: Stats
    reported: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def computed_tokens(self) -> int:
        """Input tokens the server did not find cached: computed for this request."""
        return self.input_tokens - self.cached_tokens

    @property
    def computed_share(self) -> float | None:
        return self.computed_tokens / self.input_tokens if self.input_tokens else None

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(computed_tokens=self.computed_tokens, computed_share=self.computed_share)
        return data

    @classmethod
    def from_json(cls, data: dict) -> TurnStats:
        """Back from ``to_json`` (the derived values left out)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        for k in ("ttft", "tpot", "e2e"):
            values[k] = Stats(**values[k])
        return cls(**values)


def per_turn(records: list[RequestRecord]) -> list[TurnStats]:
    """One ``TurnStats`` per turn index, in order; records without a turn are left out."""
    turns: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.turn is not None:
            turns.setdefault(r.turn, []).append(r)
    out = []
    for turn in sorted(turns):
        done = [r for r in turns[turn] if r.ok]
        usage = [r for r in done if r.server_prompt_tokens is not None]
        out.append(
            TurnStats(
                turn=turn,
                completed=len(done),
                failed=len(turns[turn]) - len(done),
                ttft=Stats.of([r.ttft for r in done if r.ttft is not None]),
                tpot=Stats.of([r.tpot for r in done if r.tpot is not None]),
                e2e=Stats.of([r.e2e for r in done if r.e2e is not None]),
                reported=len(usage),
                input_tokens=sum(r.server_prompt_tokens or 0 for r in usage),
                cached_tokens=sum(r.cached_tokens or 0 for r in usage),
                output_tokens=sum(r.output_tokens for r in done),
            )
        )
    return out
