"""``pdserve bench compare --quick`` against real tiny clusters on 127.0.0.1: it runs the
goodput sweep on both layouts, writes the curves and a report with a highest rate per
layout, and stops every process it started (pids from each cluster's ``cluster.json``).
Whether disaggregation wins is not checked here: that needs the real model."""

import argparse
import json
import os
import signal

import pytest
import yaml

from bench import cli
from bench.load.cluster import _alive, cpu_list

pytestmark = pytest.mark.integration

LAYOUTS = ("colocated", "1P1D")


def _pids(out) -> list[int]:
    pids = []
    for name in LAYOUTS:
        manifest = out / f"run-{name}" / "cluster.json"
        if manifest.is_file():
            pids += [p["pid"] for p in json.loads(manifest.read_text())["processes"]]
    return pids


def test_quick_sweep_writes_curves_and_a_highest_rate_per_layout(tiny_model, tmp_path, capsys):
    cpus = cpu_list(None)[:2]
    if len(cpus) < 2:
        pytest.fail("the sweep compares colocated with 1P1D on the same cores: it needs 2 allowed cores")
    out = tmp_path / "sweep"
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "bench",
            "compare",
            "--quick",
            "--model",
            tiny_model,
            "--out",
            str(out),
            "--cpus",
            ",".join(map(str, cpus)),
            "--launch-timeout",
            "180",
        ]
    )
    try:
        assert args.func(args) == 0
    finally:
        left = [pid for pid in _pids(out) if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert left == [] and len(_pids(out)) >= 5  # two routers, C, P and D

    # Every rate sends the same prompts: a prefix cache hit would skip their prefill.
    for name in LAYOUTS:
        assert yaml.safe_load((out / f"{name}.yaml").read_text())["engine"]["prefix_caching"] is False
    data = json.loads((out / "sweep.json").read_text())
    assert data["target"] == 0.9
    [quick] = data["scenarios"]
    rungs = [g["rate"] for g in quick["rungs"]]
    # The ladder is 2 and 8 req/s, with steps down (1, 0.5) only for a layout that misses at 2.
    assert 2.0 in rungs and set(rungs) <= {0.5, 1.0, 2.0, 8.0} and rungs == sorted(rungs)
    ladder = [g for g in quick["rungs"] if g["rate"] >= 2.0]
    assert set(ladder[0]["measured"]) == set(LAYOUTS)
    for name in LAYOUTS:
        # A layout climbs until it misses: the ladder rungs it ran are the first ones, 2 rounds of 4
        # requests each, none failed; the planner predicts every rung for every layout.
        ran = [g for g in quick["rungs"] if name in g["measured"]]
        assert [g for g in ran if g["rate"] >= 2.0] == ladder[: len([g for g in ran if g["rate"] >= 2.0])]
        assert [g["measured"][name]["num_requests"] for g in ran] == [8] * len(ran)
        assert [g["measured"][name]["failed"] for g in ran] == [0] * len(ran)
        assert [len(g["rounds"][name]) for g in ran] == [2] * len(ran)
        assert [len(g["requests"][name]) for g in ran] == [8] * len(ran)
        assert list(quick["curves"][name]) == [str(g["rate"]) for g in ran]
        assert list(quick["predicted_curves"][name]) == [str(r) for r in rungs]
        assert quick["max_rate"][name] in {None, *rungs}
        assert quick["predicted_max_rate"][name] in {None, *rungs}
    # The saved sweep replays offline: the planner rebuilt from the profile and the saved probes
    # predicts exactly what the report did.
    from bench.compare.sweep_replay import replay

    [again] = replay(out)
    for name in LAYOUTS:
        assert {str(r): a for r, a in again.predicted[name].items()} == quick["predicted_curves"][name]
        assert {str(r): a for r, a in again.measured[name].items()} == quick["curves"][name]
    assert again.crossings(predicted=True) == quick["predicted_crossing"]
    # Its step table sets each server's measured steps by kind against the simulated ones.
    for g in quick["rungs"]:
        servers = again.steps[g["rate"]]
        assert set(servers) == set(g["engines"])
        for name, by_server in servers.items():
            assert set(by_server) == ({"c0"} if name == "colocated" else {"p0", "d0"})
            for server, kinds in by_server.items():
                assert set(kinds) <= {"prefill", "decode", "mixed"}
                assert (server == "p0") == ("decode" not in kinds)  # P only prefills, live and simulated
                (n, ms), (sim_n, sim_ms) = kinds["prefill" if server == "p0" else "decode"]
                assert n > 0 and ms > 0 and sim_n > 0 and sim_ms > 0
    report = (out / "sweep.md").read_text()
    assert report.count("| colocated | ") >= 1 and report.count("| 1P1D | ") >= 1
    assert "Highest rate with >= 90% of requests meeting both SLOs" in report
    assert "| scale | colocated | 1P1D | wins |" in report
    assert (out / "sweep-quick.png").stat().st_size > 20_000
    assert "report: " in capsys.readouterr().out
