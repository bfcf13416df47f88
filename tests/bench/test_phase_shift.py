"""bench.compare.phase_shift's arithmetic: goodput and attainment per phase, the planner against the best
static layout and the per-phase oracle, switches and CPU read back from the planner. The runs themselves
launch clusters for minutes: a script, not a test."""

from __future__ import annotations

import pytest

from bench.compare.phase_shift import (
    LayoutRun,
    PhaseResult,
    decision_count,
    decision_cpu,
    load_layout,
    main,
    report,
    save_layout,
    switches,
    switches_per_phase,
)

PHASES = ["prompt", "output"]


def layout(name: str, met: list[int], decisions: list[dict] | None = None) -> LayoutRun:
    phases = [
        PhaseResult(p, 10.0, 40, m, 40 - m if name == "3P1D" and p == "output" else 0) for p, m in zip(PHASES, met)
    ]
    return LayoutRun(name, phases, [], decisions or [])


def test_goodput_is_met_requests_a_second_and_attainment_their_share():
    p = PhaseResult("prompt", 20.0, 50, 30, 2)
    assert (p.goodput, p.attainment) == (1.5, 0.6)
    assert layout("x", [30, 10]).goodput == 2.0


def test_the_planner_is_compared_with_the_best_static_layout_and_each_phases_best():
    decisions = [
        {"at": 100.0, "carried_out": None},
        {"at": 104.0, "carried_out": "switched i2 to prefill in 0.14 s"},
        {"at": 130.0, "carried_out": "failed: no decode server in rotation to become prefill"},
        {"at": 150.0, "carried_out": "switched i2 to decode in 1.50 s"},
    ]
    planner = layout("planner", [34, 36], decisions)
    planner.t0 = 100.0
    runs = [layout("3P1D", [36, 10]), layout("1P3D", [8, 39]), planner]
    table, summary = report(runs, PHASES)
    assert summary["best_static"] == "1P3D"  # 2.35 met a second against 3P1D's 2.30
    assert summary["planner_over_best_static"] == pytest.approx(3.5 / 2.35)
    assert summary["oracle_layouts"] == {"prompt": "3P1D", "output": "1P3D"}
    assert summary["planner_over_oracle"] == pytest.approx({"prompt": 34 / 36, "output": 36 / 39})
    assert summary["switches"] == [
        {"at_s": 4.0, "what": "switched i2 to prefill", "seconds": 0.14},
        {"at_s": 50.0, "what": "switched i2 to decode", "seconds": 1.5},
    ]
    assert "| 3P1D | 3.60 (90%) | 1.00 (25%, 30 failed) | 2.30 |" in table.splitlines()


def test_cpu_per_decision_is_the_histograms_mean():
    page = "pdserve_planner_decision_cpu_seconds_sum 0.5\npdserve_planner_decision_cpu_seconds_count 100.0\n"
    assert decision_cpu(page) == 0.005
    assert decision_cpu("pdserve_planner_decision_cpu_seconds_count 0.0\n") is None
    assert switches(LayoutRun("planner", [], [], [])) == []


def test_a_decisions_several_moves_are_each_a_switch_counted_in_the_phase_it_began():
    decisions = [
        {"at": 105.0, "carried_out": "switched i1 to decode in 0.11 s; switched i2 to decode in 0.09 s"},
        {"at": 112.0, "carried_out": "switched i3 to decode in 0.10 s; failed: switching i4 to decode: 502"},
        {"at": 131.0, "carried_out": "switched i3 to prefill in 0.20 s"},
    ]
    run = LayoutRun("planner", [], [], decisions, t0=100.0, phase_starts=(0.0, 10.0, 20.0))
    made = switches(run)
    assert [(s["at_s"], s["what"], s["seconds"]) for s in made] == [
        (5.0, "switched i1 to decode", 0.11),
        (5.0, "switched i2 to decode", 0.09),
        (12.0, "switched i3 to decode", 0.1),
        (31.0, "switched i3 to prefill", 0.2),
    ]
    assert switches_per_phase(run, made) == [2, 1, 1]


def test_the_process_cpu_is_read_over_every_action_and_a_saved_layout_reads_back(tmp_path):
    page = 'pdserve_planner_decisions_total{action="hold"} 40.0\npdserve_planner_decisions_total{action="switch"} 3.0\n'
    assert decision_count(page) == 43.0
    phases = [PhaseResult("prompt", 10.0, 4, 3, 1)]
    records = [("prompt", 1.5, {"ok": True, "met": True})]
    run = LayoutRun("planner", phases, records, [{"at": 3.0}], 0.001, 0.004, 2.0, (0.0,))
    save_layout(run, tmp_path / "layout.json")
    assert load_layout(tmp_path / "layout.json") == run


@pytest.mark.parametrize(
    "argv",
    [["--phases", "prompt,nope"], ["--rates", "1"], ["--instances", "1"], ["--skip-statics", "--skip-planner"]],
)
def test_a_trace_it_cannot_run_is_refused_before_anything_starts(argv, capsys):
    assert main(argv) == 2
    assert "phase_shift: error" in capsys.readouterr().err
