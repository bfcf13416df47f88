"""The goodput sweep's search logic (bench/plan/sweep.py) on hand-made attainment curves."""

import pytest

from bench.load.metrics import RequestRecord
from bench.plan.sweep import attainment, crossing, ladder, max_rate, ratio


def test_ladder_grows_by_the_factor_from_the_first_rate():
    assert ladder(0.1, 1.5, 4) == [0.1, 0.15, 0.225, 0.3375]
    assert ladder(2.0, 4.0, 2) == [2.0, 8.0]


@pytest.mark.parametrize("start,factor,count", [(0, 2, 3), (1, 1, 3), (1, 2, 0)])
def test_a_ladder_that_cannot_climb_is_refused(start, factor, count):
    with pytest.raises(ValueError, match="bad ladder"):
        ladder(start, factor, count)


def test_max_rate_is_the_last_rate_met_before_the_first_miss():
    curve = {0.1: 1.0, 0.2: 0.95, 0.4: 0.9, 0.8: 0.6}
    assert max_rate(curve, 0.9) == 0.4
    assert max_rate(curve, 0.95) == 0.2
    assert max_rate(curve, 0.5) == 0.8


def test_a_lucky_pass_above_a_miss_does_not_count():
    # Dict order is not rate order: the search sorts.
    assert max_rate({0.8: 0.95, 0.2: 1.0, 0.4: 0.5}, 0.9) == 0.2


def test_no_rate_met_gives_none_and_a_rate_with_no_requests_misses():
    assert max_rate({0.1: 0.85, 0.2: 0.5}, 0.9) is None
    assert max_rate({0.1: 1.0, 0.2: None, 0.4: 1.0}, 0.9) == 0.1
    assert max_rate({}, 0.9) is None


def test_the_crossing_is_linear_between_the_last_rung_met_and_the_first_missed():
    # 1.0 at 0.2, 0.6 at 0.4: attainment falls through 0.9 a quarter of the way up.
    assert crossing({0.1: 1.0, 0.2: 1.0, 0.4: 0.6, 0.8: 0.95}, 0.9) == pytest.approx(0.25)
    assert crossing({0.1: 0.95, 0.2: None}, 0.9) == pytest.approx(0.1 + 0.05 / 0.95 * 0.1)


def test_no_crossing_when_the_first_rung_misses_or_none_does():
    assert crossing({0.1: 0.5, 0.2: 0.3}, 0.9) is None
    assert crossing({0.1: 1.0, 0.2: 0.95}, 0.9) is None
    assert crossing({}, 0.9) is None


def _record(ttft: float, tpot: float, tokens: int = 3, ok: bool = True) -> RequestRecord:
    first = 1.0 + ttft
    times = [first + i * tpot for i in range(tokens)]
    return RequestRecord(
        index=0,
        prompt_len=8,
        max_tokens=tokens,
        start=1.0,
        end=times[-1],
        token_times=times,
        output_tokens=tokens,
        ok=ok,
        error=None if ok else "http 500",
    )


def test_attainment_scales_both_slos():
    records = [_record(0.5, 0.05), _record(1.5, 0.05), _record(0.5, 0.15), _record(0.5, 0.05, ok=False)]
    assert attainment(records, 1000, 100) == 0.25
    assert attainment(records, 1000, 100, scale=2.0) == 0.75
    assert attainment(records, 1000, 100, scale=0.4) == 0.0


def test_ratio_is_undefined_without_both_sides():
    assert ratio(0.4, 0.2) == 2.0
    assert ratio(None, 0.2) is None and ratio(0.4, None) is None and ratio(0.4, 0) is None


def test_the_verdict_says_who_carries_more_at_which_slo_scale():
    from bench.compare.compare_sweep import verdict

    text = verdict({0.5: [], 1.0: ["1P1D"], 1.5: ["colocated", "1P1D"], 2.0: ["colocated"]}, ["colocated", "1P1D"])
    assert text == (
        "Measured: neither layout meets the SLO at SLO scale 0.5; 1P1D carries more at SLO scale 1; "
        "the layouts tie (same highest rung) at SLO scale 1.5; colocated carries more at SLO scale 2."
    )


def test_a_layout_missing_the_first_rung_steps_down_and_the_others_climb_until_they_miss(monkeypatch):
    """The ladder driver on layouts whose latency is a function of the rate: "slow"
    keeps a 50 ms TPOT up to 0.1 req/s (300 ms above), "fast" up to 0.5 req/s."""
    import time
    from types import SimpleNamespace

    import bench.compare.compare_sweep as compare_sweep
    from bench.compare.compare_sweep import LadderSpec, sweep_scenario
    from bench.compare.scenarios import Scenario
    from bench.load.metrics import summarize
    from bench.load.workload import Workload

    limits = {"slow": 0.1, "fast": 0.5}
    calls = []

    def fake_run(at, sides, ctx):
        calls.append((at.rate, [s.name for s in sides]))
        out = []
        for side in sides:
            tpot = 0.05 if at.rate <= limits[side.name] else 0.3
            recs = [_record(0.5, tpot) for _ in range(at.num_requests)]
            out.append(
                SimpleNamespace(
                    layout=side.name,
                    records=recs,
                    scenario=at,
                    measured=summarize(recs, None, at.slo_ttft_ms, at.slo_tpot_ms),
                )
            )
        return out

    monkeypatch.setattr(compare_sweep, "run_scenario", fake_run)
    monkeypatch.setattr(compare_sweep, "simulated", lambda layout, at, records: records)
    sides = [SimpleNamespace(name="slow", layout=None), SimpleNamespace(name="fast", layout=None)]
    s = Scenario("s", "x", Workload.single("8", "3"), num_requests=0, rate=1.0, slo_ttft_ms=1000, slo_tpot_ms=100)
    sw = sweep_scenario(s, [0.2, 0.4, 0.8, 1.6], LadderSpec(0.2, 2.0, 4), 2, sides, {}, 0.9, time.time() + 60)
    # "slow" misses at 0.2 even with the SLOs doubled: it steps down to 0.1 alone, and leaves.
    # "fast" climbs to its first miss at 0.8.
    assert calls == [(0.2, ["slow", "fast"]), (0.1, ["slow"]), (0.4, ["fast"]), (0.8, ["fast"])]
    assert [g.rate for g in sw.rungs] == [0.1, 0.2, 0.4, 0.8]
    assert max_rate(sw.curve("slow"), 0.9) == 0.1 and max_rate(sw.curve("fast"), 0.9) == 0.4
    assert list(sw.curve("slow", predicted=True)) == [0.1, 0.2, 0.4, 0.8]
    assert sw.stopped == "every layout has missed: the last at 0.8 req/s"


def test_every_scenario_after_the_first_is_predicted_from_probes_taken_just_before_it(monkeypatch):
    """Launch calibrates each side before the first scenario; sweep_all probes every side
    again before each later one, and each scenario keeps the calibration it used."""
    import time
    from types import SimpleNamespace

    import bench.compare.compare_sweep as compare_sweep
    from bench.compare.compare_sweep import sweep_all
    from bench.compare.scenarios import Scenario
    from bench.load.metrics import summarize
    from bench.load.workload import Workload

    events = []

    def fake_calibrate(side, ctx):
        side.calibration = {"step_ms": float(len(events)), "seq_ms": 0.0, "request_ms": 0.0, "prefill_scale": 1.0}
        side.probes = {"probe": [_record(0.1, 0.01)]}
        events.append(("calibrate", side.name))

    def fake_run(at, sides, ctx):
        events.append(("run", at.name, at.rate))
        recs = [_record(0.5, 0.05) for _ in range(at.num_requests)]
        return [
            SimpleNamespace(
                layout=s.name,
                records=recs,
                scenario=at,
                calibration=s.calibration,
                measured=summarize(recs, None, at.slo_ttft_ms, at.slo_tpot_ms),
            )
            for s in sides
        ]

    monkeypatch.setattr(compare_sweep, "calibrate_side", fake_calibrate)
    monkeypatch.setattr(compare_sweep, "run_scenario", fake_run)
    monkeypatch.setattr(compare_sweep, "simulated", lambda layout, at, records: records)
    sides = [SimpleNamespace(name="a", layout=None), SimpleNamespace(name="b", layout=None)]
    for side in sides:
        fake_calibrate(side, {})  # at launch
    scenarios = [
        Scenario(name, "x", Workload.single("8", "3"), num_requests=0, rate=1.0, slo_ttft_ms=1000, slo_tpot_ms=100)
        for name in ("first", "second")
    ]
    args = SimpleNamespace(attainment=90.0, sweep_rates="1,2", sweep_requests=2)
    sweeps = sweep_all(scenarios, sides, {"deadline": time.time() + 60}, args, quick=True)
    assert events == [
        ("calibrate", "a"),
        ("calibrate", "b"),
        ("run", "first", 1.0),
        ("run", "first", 2.0),
        ("calibrate", "a"),
        ("calibrate", "b"),
        ("run", "second", 1.0),
        ("run", "second", 2.0),
    ]
    assert [sw.calibration["a"]["found"]["step_ms"] for sw in sweeps] == [0.0, 4.0]
    assert [sw.calibration["b"]["found"]["step_ms"] for sw in sweeps] == [1.0, 5.0]
    assert sweeps[1].calibration["b"]["probes"]["probe"] == [_record(0.1, 0.01).to_json()]
