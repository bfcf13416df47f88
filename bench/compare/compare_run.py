"""The layouts of ``pdserve bench compare``: launched, measured, simulated.

A ``Side`` is one layout, launched for the whole run (``start_side``) and
stopped by pid (``stop_side``). ``run_scenario`` cuts a scenario into rounds
and sends each round to every side in turn, in ABBA order, so drift on a
shared machine falls on every side alike; each side's rounds are pooled on
one clock. Every measured run comes with the planner's simulation of exactly
the requests sent, at their send times (``simulated``), from a layout
calibrated per side by tiny probe requests (``calibrate_side``,
``calibrate``): the server's fixed per-step, per-sequence and per-request
costs and its prefill speed under load, which the engine profile cannot see.

The command (``bench/compare/compare.py``) and its rate sweep
(``bench/compare/compare_sweep.py``) both run their layouts through this module.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from bench.compare.scenarios import Scenario, cluster_config
from bench.load.cluster import free_port_pairs, launch
from bench.load.loadgen import LoadConfig
from bench.load.metrics import RequestRecord, Summary, summarize
from bench.load.prompts import PromptBuilder
from bench.load.serve import request_source, run_benchmark
from bench.load.workload import RequestSpec, Workload
from bench.plan.costmodel import Overheads
from bench.plan.plan import Candidate
from bench.plan.simulate import Layout, SimResult, simulate


@dataclass
class Run:
    """One scenario measured on one layout, with the planner's prediction."""

    layout: str
    scenario: Scenario
    records: list[RequestRecord]
    measured: Summary
    predicted: Summary | None
    transfer: dict | None = None  # idle runs on xPyD, per P: accept-to-ack span (s), KV bytes
    loadavg: tuple[float, float] = (0.0, 0.0)
    calibration: dict | None = None  # the live cluster's fixed overheads the prediction used
    rounds: list[Summary] = field(default_factory=list)  # each round on its own
    engines: dict = field(default_factory=dict)  # per server: steps, mean step time by kind, preemptions


PROBE = Scenario(
    "probe",
    "8-token prompts, 16 tokens out, one at a time",
    Workload.single("8", "16"),
    num_requests=5,
    concurrency=1,
    idle=True,
)
PROBE_BATCH = Scenario(
    "probe-batch",
    "8-token prompts, 32 tokens out, four at a time",
    Workload.single("8", "32"),
    num_requests=8,
    concurrency=4,
)
PROBE_WIDE = Scenario(
    "probe-wide",
    "8-token prompts, 32 tokens out, sixteen at a time",
    Workload.single("8", "32"),
    num_requests=32,
    concurrency=16,
)
PROBE_PREFILL = Scenario(
    "probe-prefill",
    "1024-token prompts (a quarter) among 8-token ones decoding 48 tokens, eight at a time",
    Workload.mix(["0.25:1024:2", "0.75:8:48"]),
    num_requests=24,
    concurrency=8,
)


def _tpot(records: list[RequestRecord]) -> float:
    return statistics.median(r.tpot for r in records)


def calibrate(
    layout: Layout,
    records: list[RequestRecord],
    batch_records: list[RequestRecord] | None = None,
    prefill_records: list[RequestRecord] | None = None,
    wide_records: list[RequestRecord] | None = None,
) -> tuple[Layout, dict]:
    """Adds the live cluster's fixed costs, measured with tiny requests, to a layout.

    The profile times bare engine steps; a server adds a per-step cost (engine
    thread, queues, other processes on the same cores), a per-sequence cost in
    every step (each stream's token is detokenized, sent as an HTTP chunk and
    relayed by the router, on the same cores) and a per-request cost (HTTP,
    tokenization, routing, the extra hop of a disaggregated request). All three
    are read off probe requests too small for compute to matter. The TPOT gap
    (live minus simulated) of each probe is a point (width, gap); the per-step
    and per-sequence costs are the line through the two widest probes given:
    ``PROBE_BATCH`` and ``PROBE_WIDE`` (4 and 16 streams, batches like the ones
    that serve load), else one at a time and ``PROBE_BATCH``, else the
    one-at-a-time gap is all per step. A lone stream pays less than a batch
    does (nothing else competes for the cores between its steps), so a line
    from width 1 overstates the per-sequence cost of a large batch. Then the
    TTFT gap left goes into ``ingress``. Last, ``PROBE_PREFILL`` (1024-token
    prompts arriving among decoding streams) compares the live prefill under
    load with the profile's: the engine there shares its cores with the other
    servers, the router, the load client and the streams' HTTP work, which a
    profile taken alone does not see; the prefilling instances' token and
    attention costs are scaled until the simulated TTFT of the long prompts
    is the live one.
    """
    done = [r for r in records if r.ok and r.tpot is not None]
    if not done:
        return layout, {"step_ms": 0.0, "seq_ms": 0.0, "request_ms": 0.0, "prefill_scale": 1.0}
    bare = replace(layout, overheads=Overheads())
    points = [(1, _tpot(done) - predict(bare, PROBE, done).tpot.p50 / 1000)]
    for probe, recs in ((PROBE_BATCH, batch_records), (PROBE_WIDE, wide_records)):
        ok = [r for r in recs or [] if r.ok and r.tpot is not None]
        if ok:
            points.append((probe.concurrency, _tpot(ok) - predict(bare, probe, ok).tpot.p50 / 1000))
    if len(points) == 1:
        seq_gap, (w1, g1) = 0.0, points[0]
    else:
        (w0, g0), (w1, g1) = points[-2:]
        seq_gap = max(0.0, (g1 - g0) / (w1 - w0))
    step_gap = max(0.0, g1 - seq_gap * w1)

    def slower(spec):
        cost = replace(spec.cost, base=spec.cost.base + step_gap, per_seq=spec.cost.per_seq + seq_gap)
        return replace(spec, cost=cost)

    stepped = replace(bare, serving=tuple(map(slower, bare.serving)), prefill=tuple(map(slower, bare.prefill)))
    request_gap = max(0.0, statistics.median(r.ttft for r in done) - predict(stepped, PROBE, done).ttft.p50 / 1000)
    calibrated = replace(stepped, overheads=Overheads(ingress=request_gap))
    scale = 1.0
    loaded = [r for r in prefill_records or [] if r.ok]
    longest = max((r.prompt_len for r in loaded), default=0)
    long = [i for i, r in enumerate(loaded) if r.prompt_len == longest and r.ttft is not None]
    if long:
        scale = _prefill_scale(calibrated, loaded, long)
        calibrated = _scaled_prefill(calibrated, scale)
    return calibrated, {
        "step_ms": 1000 * step_gap,
        "seq_ms": 1000 * seq_gap,
        "request_ms": 1000 * request_gap,
        "prefill_scale": scale,
    }


CALIBRATION_PROBES = (PROBE, PROBE_BATCH, PROBE_WIDE, PROBE_PREFILL)


def calibrate_from_probes(layout: Layout, probes: dict[str, list[RequestRecord]]) -> tuple[Layout, dict]:
    """``calibrate`` from the records of ``CALIBRATION_PROBES``, by probe name."""
    return calibrate(
        layout,
        probes[PROBE.name],
        probes.get(PROBE_BATCH.name),
        probes.get(PROBE_PREFILL.name),
        probes.get(PROBE_WIDE.name),
    )


def _scaled_prefill(layout: Layout, scale: float) -> Layout:
    """The prefilling instances' token and attention costs times ``scale``."""

    def live(spec):
        return replace(
            spec, cost=replace(spec.cost, per_token=spec.cost.per_token * scale, per_attn=spec.cost.per_attn * scale)
        )

    if layout.prefill:
        return replace(layout, prefill=tuple(map(live, layout.prefill)))
    return replace(layout, serving=tuple(map(live, layout.serving)))


def _prefill_scale(layout: Layout, records: list[RequestRecord], long: list[int]) -> float:
    """The scale of prefill compute at which the simulated median TTFT of the ``long``
    requests (positions in ``records``) equals the live one, by bisection in [0.5, 4]:
    among running decodes a long prompt also waits for the step in flight, so its TTFT
    is not linear in the scale."""
    target = statistics.median(records[i].ttft for i in long)

    def ttft(scale: float) -> float:
        sim = simulated(_scaled_prefill(layout, scale), PROBE_PREFILL, records)
        return statistics.median(sim[i].ttft for i in long)

    lo, hi = 0.5, 4.0
    if ttft(lo) >= target:
        return lo
    if ttft(hi) <= target:
        return hi
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ttft(mid) < target else (lo, mid)
    return (lo + hi) / 2


def measure(url: str, model: str, scenario: Scenario, builder: PromptBuilder, seed: int) -> list[RequestRecord]:
    config = LoadConfig(
        url=url,
        model=model,
        concurrency=scenario.concurrency,
        rate=scenario.rate,
        num_requests=scenario.num_requests,
        request_timeout=600.0,
        seed=seed,
    )
    source = request_source(scenario.workload, builder, "tokens", seed)
    return run_benchmark(config, source, warmup=1, progress=True).records


def simulation(layout, scenario: Scenario, records: list[RequestRecord]) -> SimResult:
    """The planner's simulation of exactly the requests sent, at their send times."""
    specs = [RequestSpec(i, r.prompt_len, r.max_tokens) for i, r in enumerate(records)]
    # Idle runs send one request at a time: simulate them far apart.
    arrivals = [1000.0 * i for i in range(len(records))] if scenario.idle else [r.start for r in records]
    return simulate(layout, specs, arrivals)


def simulated(layout, scenario: Scenario, records: list[RequestRecord]) -> list[RequestRecord]:
    """The simulated records of :func:`simulation`."""
    return simulation(layout, scenario, records).records


def predict(layout, scenario: Scenario, records: list[RequestRecord]) -> Summary:
    return summarize_pooled([simulated(layout, scenario, records)], scenario)


def shifted(records: list[RequestRecord], dt: float, first_index: int) -> list[RequestRecord]:
    """Records moved ``dt`` seconds later and renumbered from ``first_index``."""
    return [
        replace(
            r, index=first_index + i, start=r.start + dt, end=r.end + dt, token_times=[t + dt for t in r.token_times]
        )
        for i, r in enumerate(records)
    ]


def pooled(rounds: list[list[RequestRecord]]) -> list[RequestRecord]:
    """Rounds laid end to end on one clock: run_duration of the pool is the sum of
    the rounds' durations, so rates and goodput come out per second of load."""
    out: list[RequestRecord] = []
    for part in rounds:
        if not part:
            continue
        t0 = min(r.start for r in part)
        end = max((r.end for r in out), default=0.0)
        out += shifted(part, end - t0, len(out))
    return out


def summarize_pooled(rounds: list[list[RequestRecord]], scenario: Scenario) -> Summary:
    return summarize(pooled(rounds), None, scenario.slo_ttft_ms, scenario.slo_tpot_ms)


def split_rounds(scenario: Scenario) -> list[Scenario]:
    """The scenario cut into ``scenario.rounds`` parts (at least one request each)."""
    k = max(1, min(scenario.rounds, scenario.num_requests))
    sizes = [scenario.num_requests // k + (1 if i < scenario.num_requests % k else 0) for i in range(k)]
    return [replace(scenario, num_requests=n) for n in sizes]


def round_order(sides: list, k: int) -> list:
    """ABBA: every side goes first as often as last, so slow drift of the machine
    (other jobs, heat) falls on every side alike."""
    return list(sides) if k % 2 == 0 else list(reversed(sides))


def _transfer_summary(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """Per prefill server and request, from two reads of every server's samples
    (``RunningCluster.samples``): accept-to-ack seconds, prefill-end-to-ack
    (exposed) seconds and KV bytes."""
    out = {}
    for name, now in after.items():
        was = before.get(name, {})

        def delta(key, now=now, was=was):
            return now.get(key, 0.0) - was.get(key, 0.0)

        n = delta("pdserve_transfer_seconds_count")
        if n > 0:
            out[name] = {
                "span_s": delta("pdserve_transfer_seconds_sum") / n,
                "exposed_s": delta("pdserve_transfer_exposed_seconds_sum") / n,
                "bytes": delta("pdserve_transfer_bytes_total") / n,
            }
    return out


def engine_activity(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """Per server, from its engine counters: steps, mean step time by kind, preemptions."""
    out = {}
    for name, now in after.items():
        was = before.get(name, {})

        def delta(key, now=now, was=was):
            return now.get(key, 0.0) - was.get(key, 0.0)

        row = {"preemptions": delta("pdserve_preemptions_total")}
        for kind in ("prefill", "decode", "mixed"):
            n = delta(f'pdserve_engine_steps_total{{kind="{kind}"}}')
            row[f"{kind}_steps"] = n
            row[f"{kind}_step_ms"] = (
                1000 * delta(f'pdserve_engine_step_seconds_total{{kind="{kind}"}}') / n if n else None
            )
        out[name] = row
    return out


@dataclass
class Side:
    """One layout of the comparison, launched for the whole run."""

    name: str
    cand: Candidate
    prefill_threads: int | None = None
    idle_only: bool = False
    cluster: object = None
    layout: Layout | None = None
    calibration: dict | None = None
    probes: dict = field(default_factory=dict)  # probe scenario name -> the records calibrated with
    probe_sets: list = field(default_factory=list)  # every measurement of the probes, in order


def start_side(side: Side, ctx: dict) -> None:
    """Launches one layout and calibrates its prediction with probe requests."""
    out_dir: Path = ctx["out"]
    ports = free_port_pairs(1 + side.cand.instances)
    config = cluster_config(side.cand, ctx["model"], ports, ctx["knobs"], side.prefill_threads)
    config_path = out_dir / f"{side.name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"== {side.name}: launching {config_path} on cores {ctx['cpus']}", flush=True)
    side.cluster = launch(config_path, out_dir / f"run-{side.name}", ctx["cpus"], ctx["launch_timeout"])
    calibrate_side(side, ctx)


def calibrate_side(side: Side, ctx: dict) -> None:
    """Sends the probe requests to a running side and calibrates its prediction from
    them, pooled with the side's earlier measurements of the same probes: each one is a
    few dozen requests on a shared machine, and the per-step gap read off one set ranged
    from 2 to 26 ms over launches, so more requests beat the most recent ones alone."""
    side.probe_sets.append(
        {
            s.name: measure(side.cluster.url, side.cluster.model, s, ctx["builder"], ctx["seed"])
            for s in CALIBRATION_PROBES
        }
    )
    side.probes = {s.name: pooled([probes[s.name] for probes in side.probe_sets]) for s in CALIBRATION_PROBES}
    side.layout, side.calibration = calibrate_from_probes(
        ctx["layout_for"](side.cand, side.prefill_threads), side.probes
    )
    print(
        f"   {side.name} calibration: +{side.calibration['step_ms']:.1f} ms per step, "
        f"+{side.calibration['seq_ms']:.1f} ms per sequence in a step, +{side.calibration['request_ms']:.1f} ms "
        f"per request, prefill x{side.calibration['prefill_scale']:.2f} of the profile's",
        flush=True,
    )


def calibration_record(side: Side) -> dict:
    """What a side was calibrated with, for sweep.json (``bench.compare.sweep_replay`` reads it)."""
    return {"found": side.calibration, "probes": {k: [r.to_json() for r in v] for k, v in side.probes.items()}}


def stop_side(side: Side) -> None:
    if side.cluster is not None:
        killed = side.cluster.stop()
        if killed:
            print(f"warning: had to SIGKILL pids {killed} of {side.name}", flush=True)


def run_scenario(scenario: Scenario, sides: list[Side], ctx: dict) -> list[Run]:
    """The scenario's rounds, each sent to every side in ABBA order."""
    rounds = {s.name: [] for s in sides}
    loads = {s.name: [] for s in sides}
    before = {s.name: s.cluster.samples() for s in sides}
    for k, part in enumerate(split_rounds(scenario)):
        for side in round_order(sides, k):
            print(f"-- {scenario.name} round {k + 1}: {side.name}", flush=True)
            load0 = os.getloadavg()[0]
            rounds[side.name].append(
                measure(side.cluster.url, side.cluster.model, part, ctx["builder"], ctx["seed"] + k)
            )
            loads[side.name].append((load0, os.getloadavg()[0]))
    runs = []
    for side in sides:
        after = side.cluster.samples()
        transfer = _transfer_summary(before[side.name], after) if scenario.idle and side.cand.num_prefill else None
        parts = rounds[side.name]
        activity = engine_activity(before[side.name], after)
        loadavg = (max(a for a, _ in loads[side.name]), max(b for _, b in loads[side.name]))
        runs.append(
            Run(
                side.name,
                scenario,
                pooled(parts),
                summarize_pooled(parts, scenario),
                summarize_pooled([simulated(side.layout, scenario, p) for p in parts], scenario),
                transfer,
                loadavg,
                side.calibration,
                [summarize_pooled([p], scenario) for p in parts],
                activity,
            )
        )
    return runs
