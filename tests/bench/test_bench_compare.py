"""bench compare's pieces that need no running cluster."""

import os
import socket
from dataclasses import replace

import pytest

from bench.compare.compare_report import wire_ms, write_report
from bench.compare.compare_run import Run, pooled, predict, round_order, split_rounds
from bench.compare.scenarios import EngineKnobs, Scenario, cluster_config, default_scenarios, parse_rates, select
from bench.load.cluster import LISTEN_FLOOR, cpu_list, ephemeral_range, free_port_pairs, free_ports
from bench.load.metrics import RequestRecord, summarize
from bench.load.workload import Workload
from bench.plan.costmodel import Overheads
from bench.plan.plan import Candidate, EngineSettings, build_layout
from deploy.config import parse_config
from tests.bench.helpers import fake_profile


def test_generated_configs_give_colocated_every_core_and_split_them_for_1p1d():
    knobs = EngineKnobs()
    co = cluster_config(Candidate(0, 1, 2), "/m", [9000, 9002], knobs)
    assert co["engine"]["num_threads"] == 2 and co["colocated"] == [{"name": "c0", "port": 9002}]
    assert co["router"]["port"] == 9000 and "prefill" not in co
    pd = cluster_config(Candidate(1, 1, 1), "/m", [9000, 9002, 9004], knobs, prefill_threads=2)
    assert pd["engine"]["num_threads"] == 1
    assert pd["prefill"] == [{"name": "p0", "port": 9002, "num_threads": 2}]
    assert pd["decode"] == [{"name": "d0", "port": 9004}] and pd["transfer"] == {"backend": "zmq"}
    with pytest.raises(ValueError, match="needs 3 ports"):
        cluster_config(Candidate(1, 1, 1), "/m", [9000, 9002], knobs)


def test_generated_configs_pass_the_launchers_strict_validation():
    layouts = {}
    for cand in (Candidate(0, 1, 2), Candidate(1, 1, 1), Candidate(2, 1, 1)):
        cluster = parse_config(cluster_config(cand, "tiny", [9000, 9002, 9004, 9006], EngineKnobs()), "generated")
        layouts[cand.name] = (cluster.mode, [(i.name, cluster.role_of(i.name), i.port) for i in cluster.instances()])
    assert layouts == {
        "colocated": ("colocated", [("c0", "colocated", 9002)]),
        "1P1D": ("disaggregated", [("p0", "prefill", 9002), ("d0", "decode", 9004)]),
        "2P1D": ("disaggregated", [("p0", "prefill", 9002), ("p1", "prefill", 9004), ("d0", "decode", 9006)]),
    }


def test_scenarios_select_scale_and_rate_overrides():
    names = [s.name for s in default_scenarios()]
    assert names == ["prefill-heavy", "short", "idle-2k"]
    (heavy, idle) = select("prefill-heavy,idle-2k", scale=0.5, rates={"prefill-heavy": 0.5})
    assert heavy.rate == 0.5 and heavy.num_requests == 20
    assert idle.num_requests == 3 and idle.idle  # idle runs are not scaled
    with pytest.raises(ValueError, match="unknown scenario"):
        select("nope")
    with pytest.raises(ValueError, match="not run"):
        select("short", rates={"prefill-heavy": 1.0})
    assert parse_rates(["short=2", "prefill-heavy=0.3"]) == {"short": 2.0, "prefill-heavy": 0.3}
    with pytest.raises(ValueError, match="NAME=REQ_PER_S"):
        parse_rates(["short"])


def test_cpu_lists_parse_and_stay_within_the_allowed_cores():
    allowed = sorted(os.sched_getaffinity(0))
    assert cpu_list(None) == allowed
    assert cpu_list(f"{allowed[0]}") == [allowed[0]]
    with pytest.raises(ValueError, match="bad CPU list"):
        cpu_list("a-b")
    with pytest.raises(ValueError, match="may not use"):
        cpu_list("100000")


def test_free_port_pairs_are_distinct_and_leave_room_for_the_kv_port():
    ports = free_port_pairs(4)
    used = ports + [p + 1 for p in ports]
    assert len(set(used)) == 8


def test_free_ports_are_drawn_below_the_ephemeral_range_and_bindable():
    """Outgoing connections take their local ports from the ephemeral range; a server's port picked there
    could be taken before the server binds it."""
    low, _ = ephemeral_range()
    ports = free_ports(6) + free_port_pairs(3)
    assert len(set(ports)) == 9 and all(LISTEN_FLOOR <= p and p + 1 < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_wire_time_is_bytes_over_bandwidth():
    assert wire_ms(50e6, 0.5e9) == pytest.approx(100.0)
    assert wire_ms(None, 1e9) is None


def idle_scenario():
    return Scenario("idle-2k", "one at a time", Workload.single("100", "3"), 2, concurrency=1, idle=True)


def test_idle_prediction_simulates_each_request_alone():
    profile = fake_profile()
    layout = build_layout(Candidate(0, 1, 1), profile, EngineSettings(), Overheads())
    recs = [RequestRecord(i, 100, 3, start=0.5 * i, ok=True) for i in range(2)]
    predicted = predict(layout, idle_scenario(), recs)
    # 5 ms + 100 x 1 ms prefill, each request alone.
    assert predicted.ttft.mean == pytest.approx(105.0)
    assert predicted.tpot.mean == pytest.approx(6.0)


def record(i, ttft, tpot, n=4):
    first = i + ttft
    return RequestRecord(
        i,
        100,
        n,
        start=float(i),
        end=first + tpot * (n - 1),
        ok=True,
        output_tokens=n,
        token_times=[first + tpot * k for k in range(n)],
    )


def test_report_has_headline_ratios_planner_errors_and_idle_transfer(tmp_path):
    heavy = Scenario(
        "prefill-heavy", "long and short", Workload.single("100", "4"), 2, rate=1.0, slo_ttft_ms=1000, slo_tpot_ms=50
    )
    co = [record(0, 0.2, 0.100), record(1, 0.2, 0.020)]
    pd = [record(0, 0.3, 0.020), record(1, 0.3, 0.020)]

    def s(recs, sc):
        return summarize(recs, 2.0, sc.slo_ttft_ms, sc.slo_tpot_ms)

    idle = idle_scenario()
    # Round 1: colocated meets the 50 ms TPOT SLO with one request of two, 1P1D with both; round 2: both.
    co_rounds = [s(co, heavy), s([record(0, 0.2, 0.020), record(1, 0.2, 0.020)], heavy)]
    pd_rounds = [s(pd, heavy), s(pd, heavy)]
    runs = [
        Run("colocated", heavy, co, s(co, heavy), s(co, heavy), None, (1.0, 1.2), rounds=co_rounds),
        Run(
            "1P1D",
            heavy,
            pd,
            s(pd, heavy),
            s(co, heavy),
            None,
            (1.0, 1.0),
            rounds=pd_rounds,
            engines={
                "d0": {
                    "prefill_steps": 0,
                    "prefill_step_ms": None,
                    "decode_steps": 90,
                    "decode_step_ms": 41.25,
                    "mixed_steps": 0,
                    "mixed_step_ms": None,
                    "preemptions": 2,
                }
            },
        ),
        Run("colocated", idle, [record(0, 1.0, 0.01)], s([record(0, 1.0, 0.01)], idle), None),
        Run(
            "1P1D-P2t",
            idle,
            [record(0, 1.01, 0.01)],
            s([record(0, 1.01, 0.01)], idle),
            None,
            {"p0": {"span_s": 1.0, "exposed_s": 0.030, "bytes": 50e6}},
        ),
    ]
    meta = {
        "model": "m",
        "cpus": [0, 1],
        "layout": "1P1D",
        "threads": {"colocated": 2, "1P1D": 1},
        "wall_s": 60,
        "command": "pdserve bench compare",
        "transfer": {"bandwidth": 0.5e9, "source": "test", "tail_2k_s": {1: 0.008}},
    }
    text = write_report(tmp_path, runs, meta).read_text()
    assert "| prefill-heavy | goodput (req/s) | 0.500 | 1.000 | 2.00x | 2.00x, 1.00x |" in text
    # The sweep re-scores the pooled records: at 150 ms colocated's 100 ms request is good too.
    assert "| 50 (scenario's SLO) | 0.500 | 1.000 | 2.00x |" in text
    assert "| 150 | 1.000 | 1.000 | 1.00x |" in text
    assert "| prefill-heavy | p99 TPOT (ms) | 99.2 | 20.0 | 0.20x |" in text
    assert "| prefill-heavy | 1P1D | 200.0 | 300.0 | -33% |" in text
    assert "| 1P1D-P2t | 1010.0 | - | 1.01x | 50.00 | 100.0 | 1000.0 | 30.0 | 70.0 ms (70%) |" in text
    assert "exposed tail of a 2048-token prompt at 8.0 ms (P with 1 thread)" in text
    assert "| prefill-heavy | 1P1D | d0 | - | 90, 41.2 | - | 2 |" in text
    assert (tmp_path / "prefill-heavy-latency_cdf.png").is_file()


def test_calibration_reads_fixed_step_and_request_costs_off_probe_requests():
    from bench.compare.compare_run import PROBE, calibrate

    layout = build_layout(Candidate(0, 1, 1), fake_profile(), EngineSettings(), Overheads())
    # Bare engine: prefill of 8 tokens 13 ms, decode step 6 ms. The live server
    # shows TTFT 20 + 13 ms... and TPOT 6 + 4 ms.
    step, request = 0.004, 0.020
    recs = []
    for i in range(3):
        first = i + request + 0.013 + step
        n = PROBE.workload.classes[0].output.upper
        recs.append(
            RequestRecord(
                i,
                8,
                n,
                start=float(i),
                end=first + (0.006 + step) * (n - 1),
                ok=True,
                output_tokens=n,
                token_times=[first],
            )
        )
    calibrated, found = calibrate(layout, recs)
    assert found["step_ms"] == pytest.approx(4.0)
    assert found["request_ms"] == pytest.approx(20.0)
    again = predict(calibrated, PROBE, recs)
    assert again.ttft.mean == pytest.approx(1000 * (request + 0.013 + step))
    assert again.tpot.mean == pytest.approx(10.0)


def test_rounds_split_evenly_alternate_abba_and_pool_end_to_end():
    heavy = Scenario("h", "x", Workload.single("100", "4"), 41, rate=1.0, rounds=3)
    assert [r.num_requests for r in split_rounds(heavy)] == [14, 14, 13]
    assert [r.num_requests for r in split_rounds(Scenario("i", "x", Workload.single("1", "1"), 2, rounds=3))] == [1, 1]
    assert [round_order(["A", "B"], k) for k in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]
    # Two rounds, each on its own clock from 5 s: laid end to end, 3 s then 0.3 s of load.
    one = [record(5, 0.5, 0.1), RequestRecord(6, 100, 4, start=6.0, end=8.0, ok=False, error="x")]
    two = [record(5, 0.2, 0.1, n=2)]
    pool = pooled([one, two])
    assert [r.index for r in pool] == [0, 1, 2]
    assert [r.start for r in pool] == [0.0, 1.0, 3.0]
    assert pool[2].token_times == pytest.approx([3.2, 3.3]) and pool[2].end == pytest.approx(3.3)
    assert summarize(pool).duration_s == pytest.approx(3.3)
    assert (pool[0].ttft, pool[1].ok) == (pytest.approx(0.5), False)


def test_calibration_splits_the_tpot_gap_into_per_step_and_per_sequence_costs():
    from bench.compare.compare_run import PROBE, PROBE_BATCH, calibrate

    layout = build_layout(Candidate(0, 1, 1), fake_profile(), EngineSettings(), Overheads())
    bare = [RequestRecord(i, 8, 16, start=float(i), ok=True) for i in range(3)]
    wide = [RequestRecord(i, 8, 32, start=0.0, ok=True) for i in range(PROBE_BATCH.concurrency)]
    tpot1 = predict(layout, PROBE, bare).tpot.p50 / 1000
    tpot4 = predict(layout, PROBE_BATCH, wide).tpot.p50 / 1000
    # The live server: +2 ms per step and +3 ms per sequence in the step.
    step, seq = 0.002, 0.003

    def live(recs, tpot, width):
        out = []
        for r in recs:
            first = r.start + 0.05
            n = r.max_tokens
            out.append(
                RequestRecord(
                    r.index,
                    r.prompt_len,
                    n,
                    start=r.start,
                    end=first + (tpot + step + seq * width) * (n - 1),
                    ok=True,
                    output_tokens=n,
                    token_times=[first],
                )
            )
        return out

    _, found = calibrate(layout, live(bare, tpot1, 1), live(wide, tpot4, PROBE_BATCH.concurrency))
    assert found["seq_ms"] == pytest.approx(3.0)
    assert found["step_ms"] == pytest.approx(2.0)


def test_with_a_wide_probe_the_per_sequence_cost_is_the_line_through_the_two_batches():
    from bench.compare.compare_run import PROBE, PROBE_BATCH, PROBE_WIDE, calibrate

    layout = build_layout(Candidate(0, 1, 1), fake_profile(), EngineSettings(), Overheads())
    probes = {
        PROBE: [RequestRecord(i, 8, 16, start=float(i), ok=True) for i in range(3)],
        PROBE_BATCH: [RequestRecord(i, 8, 32, start=0.0, ok=True) for i in range(PROBE_BATCH.concurrency)],
        PROBE_WIDE: [RequestRecord(i, 8, 32, start=0.0, ok=True) for i in range(PROBE_WIDE.concurrency)],
    }
    # A lone stream pays 1 ms a step; a batch 10 ms a step and 0.5 ms per sequence in it.
    gaps = {
        1: 0.001,
        PROBE_BATCH.concurrency: 0.010 + 0.0005 * PROBE_BATCH.concurrency,
        PROBE_WIDE.concurrency: 0.010 + 0.0005 * PROBE_WIDE.concurrency,
    }
    live = {}
    for probe, recs in probes.items():
        tpot = predict(layout, probe, recs).tpot.p50 / 1000 + gaps[probe.concurrency or 1]
        live[probe] = [
            RequestRecord(
                r.index,
                r.prompt_len,
                r.max_tokens,
                start=r.start,
                end=r.start + 0.05 + tpot * (r.max_tokens - 1),
                ok=True,
                output_tokens=r.max_tokens,
                token_times=[r.start + 0.05],
            )
            for r in recs
        ]
    _, found = calibrate(layout, live[PROBE], live[PROBE_BATCH], None, live[PROBE_WIDE])
    assert found["seq_ms"] == pytest.approx(0.5)
    assert found["step_ms"] == pytest.approx(10.0)
    # Without the wide probe the line starts at the lone stream: (12 - 1) / 3 ms per sequence, nothing
    # left per step, so 16 streams would pay 59 ms a step instead of 18.
    _, found = calibrate(layout, live[PROBE], live[PROBE_BATCH])
    assert found["seq_ms"] == pytest.approx(11 / 3) and found["step_ms"] == pytest.approx(0.0, abs=1e-9)


def test_calibration_scales_prefill_compute_to_the_live_cluster_under_load():
    from bench.compare.compare_run import PROBE, PROBE_PREFILL, calibrate, simulated

    layout = build_layout(Candidate(0, 1, 1), fake_profile(), EngineSettings(), Overheads())
    probe = [RequestRecord(i, 8, 16, start=float(i), ok=True) for i in range(3)]
    tpot = predict(layout, PROBE, probe).tpot.p50 / 1000
    ttft = predict(layout, PROBE, probe).ttft.p50 / 1000
    probe = [
        RequestRecord(
            r.index,
            8,
            16,
            start=r.start,
            end=r.start + ttft + 15 * tpot,
            ok=True,
            output_tokens=16,
            token_times=[r.start + ttft],
        )
        for r in probe
    ]
    # Two 1024-token prompts, each arriving while 8-token requests decode (so it waits for their step).
    sent = [
        RequestRecord(0, 8, 48, start=0.0),
        RequestRecord(1, 1024, 2, start=0.005),
        RequestRecord(2, 8, 48, start=50.0),
        RequestRecord(3, 1024, 2, start=50.005),
    ]
    cost = layout.serving[0].cost
    # The live cluster prefills 30% slower under load than the profile measured alone.
    slow = replace(
        layout,
        serving=(
            replace(
                layout.serving[0], cost=replace(cost, per_token=1.3 * cost.per_token, per_attn=1.3 * cost.per_attn)
            ),
        ),
    )
    live = [replace(r, ok=True) for r in simulated(slow, PROBE_PREFILL, sent)]
    calibrated, found = calibrate(layout, probe, None, live)
    assert (found["step_ms"], found["request_ms"]) == (pytest.approx(0.0, abs=1e-6), pytest.approx(0.0, abs=1e-6))
    assert found["prefill_scale"] == pytest.approx(1.3, rel=1e-3)
    assert calibrated.serving[0].cost.per_token == pytest.approx(1.3 * cost.per_token, rel=1e-3)
    again = simulated(calibrated, PROBE_PREFILL, live)
    assert [r.ttft for r in again] == pytest.approx([r.ttft for r in live], rel=1e-3)


def test_transfer_and_engine_activity_come_from_two_reads_of_the_servers_samples():
    from bench.compare.compare_run import _transfer_summary, engine_activity

    before = {
        "p0": {
            "pdserve_transfer_seconds_count": 2,
            "pdserve_transfer_seconds_sum": 5.0,
            "pdserve_transfer_exposed_seconds_sum": 0.01,
            "pdserve_transfer_bytes_total": 100.0,
            'pdserve_engine_steps_total{kind="prefill"}': 4,
            'pdserve_engine_step_seconds_total{kind="prefill"}': 8,
        },
        "d0": {},
    }
    after = {
        "p0": {
            "pdserve_transfer_seconds_count": 5,
            "pdserve_transfer_seconds_sum": 14.0,
            "pdserve_transfer_exposed_seconds_sum": 0.031,
            "pdserve_transfer_bytes_total": 400.0,
            'pdserve_engine_steps_total{kind="prefill"}': 7,
            'pdserve_engine_step_seconds_total{kind="prefill"}': 17,
            "pdserve_preemptions_total": 1,
        },
        "d0": {
            'pdserve_engine_steps_total{kind="decode"}': 10,
            'pdserve_engine_step_seconds_total{kind="decode"}': 0.5,
        },
    }
    got = _transfer_summary(before, after)
    assert got.keys() == {"p0"}
    assert got["p0"] == {"span_s": pytest.approx(3.0), "exposed_s": pytest.approx(0.007), "bytes": pytest.approx(100.0)}
    activity = engine_activity(before, after)
    assert activity["p0"]["prefill_steps"] == 3 and activity["p0"]["prefill_step_ms"] == pytest.approx(3000.0)
    assert activity["p0"]["preemptions"] == 1 and activity["p0"]["decode_step_ms"] is None
    assert activity["d0"]["decode_steps"] == 10 and activity["d0"]["decode_step_ms"] == pytest.approx(50.0)


def test_a_side_calibrates_from_every_probe_set_it_measured_pooled(monkeypatch):
    from types import SimpleNamespace

    import bench.compare.compare_run as compare_run

    layout = build_layout(Candidate(0, 1, 1), fake_profile(), EngineSettings(), Overheads())
    sets = iter([0.004, 0.012])  # the per-step gap each measurement of the probes shows

    def fake_measure(url, model, scenario, builder, seed):
        gap = current[0]
        n = scenario.workload.classes[0].output.upper if scenario.name == compare_run.PROBE.name else 0
        if not n:
            return []
        bare = compare_run.simulated(layout, scenario, [RequestRecord(i, 8, n, start=float(i)) for i in range(3)])
        return [replace(r, ok=True, end=r.end + gap * (n - 1), token_times=r.token_times[:1]) for r in bare]

    monkeypatch.setattr(compare_run, "measure", fake_measure)
    side = SimpleNamespace(
        name="colocated",
        cand=Candidate(0, 1, 1),
        prefill_threads=None,
        probe_sets=[],
        cluster=SimpleNamespace(url="", model=""),
    )
    ctx = {"builder": None, "seed": 0, "layout_for": lambda cand, threads: layout}
    current = [next(sets)]
    compare_run.calibrate_side(side, ctx)
    assert side.calibration["step_ms"] == pytest.approx(4.0)
    current = [next(sets)]
    compare_run.calibrate_side(side, ctx)
    # Six one-at-a-time probes now, three at +4 ms a step and three at +12: the median's gap.
    probe = side.probes[compare_run.PROBE.name]
    assert len(probe) == 6 and [r.index for r in probe] == list(range(6))
    assert side.calibration["step_ms"] == pytest.approx(8.0)
    assert compare_run.calibration_record(side)["probes"][compare_run.PROBE.name] == [r.to_json() for r in probe]
