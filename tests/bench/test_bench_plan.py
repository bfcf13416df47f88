"""The planner: candidates, recommendation, the command, and the profiler."""

import dataclasses
import json
from dataclasses import astuple

import pytest

from bench.load.workload import Workload
from bench.plan.costmodel import (
    AllReduceCost,
    Overheads,
    StepCost,
    StepSample,
    chunk_attn_pairs,
    fit_step_cost,
    split_step_cost,
)
from bench.plan.plan import Candidate, EngineSettings, build_layout, candidates, evaluate, recommend
from bench.plan.profile import Profile, ProfileGrid, profile_engine
from tests.bench.helpers import fake_profile


def test_candidates_on_two_cores_are_colocated_split_and_1p1d():
    assert [(c.name, c.threads) for c in candidates(2)] == [("colocated", 2), ("colocated x2", 1), ("1P1D", 1)]
    assert [c.name for c in candidates(3)] == ["colocated", "colocated x2", "1P1D", "colocated x3", "1P2D", "2P1D"]
    assert [c.threads for c in candidates(4, max_instances=2)] == [4, 2, 2]
    assert {c.threads for c in candidates(4, per_device=True)} == {1}


def test_layout_names_parse():
    assert Candidate.parse("2p1d", 4, False) == Candidate(2, 1, 1)
    assert Candidate.parse("colocated", 4, False) == Candidate(0, 1, 4)
    assert Candidate.parse("colocated x2", 4, False) == Candidate(0, 2, 2)
    with pytest.raises(ValueError, match="only 2 fit"):
        Candidate.parse("2p1d", 2, False)
    with pytest.raises(ValueError, match="bad layout"):
        Candidate.parse("mesh", 2, False)


def plan(workload, rate, slo_ttft_ms, slo_tpot_ms, profile=None):
    profile = profile or fake_profile()
    layouts = [(c, build_layout(c, profile, EngineSettings(), Overheads())) for c in candidates(2)]
    preds = evaluate(layouts, workload, rate, 120, slo_ttft_ms, slo_tpot_ms, seed=1)
    return {p.candidate.name: p for p in preds}, recommend(preds)


def test_prefill_heavy_mix_under_tight_tpot_recommends_1p1d():
    # 1000-token prompts (0.6 s of prefill even on two threads) stall the
    # short requests' decodes when colocated; on 1P1D they only queue on P.
    workload = Workload.mix(["0.2:1000:8", "0.8:32:32"])
    preds, best = plan(workload, rate=1.0, slo_ttft_ms=5000, slo_tpot_ms=10)
    assert best.candidate.name == "1P1D"
    assert preds["1P1D"].summary.tpot.p99 < 0.2 * preds["colocated"].summary.tpot.p99
    assert preds["1P1D"].summary.slo_attainment == 1.0 > preds["colocated"].summary.slo_attainment


def test_short_prompts_recommend_colocated_with_every_core():
    workload = Workload.single("16", "32")
    preds, best = plan(workload, rate=2.0, slo_ttft_ms=100, slo_tpot_ms=8)
    assert best.candidate.name == "colocated"
    assert preds["colocated"].summary.tpot.mean < preds["1P1D"].summary.tpot.mean


def test_near_ties_go_to_fewer_instances():
    workload = Workload.single("16", "4")
    _, best = plan(workload, rate=0.5, slo_ttft_ms=10_000, slo_tpot_ms=10_000)
    assert best.candidate.name == "colocated"


def test_plan_command_prints_a_table_and_writes_json(tmp_path, capsys):
    import argparse

    from bench import cli

    path = tmp_path / "profile.json"
    fake_profile().save(path)
    p = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(
        [
            "plan",
            "--profile",
            str(path),
            "--cores",
            "2",
            "--rate",
            "1",
            "--num-requests",
            "40",
            "--mix",
            "0.2:1000:8",
            "--mix",
            "0.8:32:32",
            "--slo-ttft-ms",
            "5000",
            "--slo-tpot-ms",
            "10",
            "--json",
            str(tmp_path / "plan.json"),
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "| 1P1D **(recommended)** |" in out and "| colocated |" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["recommended"] == "1P1D" and len(data["predictions"]) == 3


def test_fit_recovers_the_coefficients_of_exact_samples():
    truth = StepCost(0.004, 2e-4, 3e-8, 1e-3)
    shapes = [(n, chunk_attn_pairs(0, n), 1) for n in (16, 128, 512, 2048)]
    shapes += [(b, b * (c + 1), b) for b in (1, 8, 32) for c in (64, 512)]
    samples = [StepSample(n, a, s, truth.step_time(n, a, s)) for n, a, s in shapes]
    fit = fit_step_cost(samples)
    for name in ("base", "per_token", "per_attn", "per_seq"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_fit_never_returns_negative_costs():
    samples = [StepSample(n, 0, 1, 0.01 - n * 1e-6) for n in (1, 10, 100, 1000, 2000)]
    fit = fit_step_cost(samples)
    assert min(fit.base, fit.per_token, fit.per_attn, fit.per_seq) >= 0


@pytest.mark.slow
def test_profile_of_the_tiny_model_round_trips_through_json(tiny_model, tmp_path):
    profile = profile_engine(tiny_model, [1], ProfileGrid.quick(), progress=lambda _: None, bar=False)
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, K/V, kv heads, head dim, float32
    assert profile.num_layers == 2 and profile.transfer_bandwidth > 0
    cost = profile.cost(1)
    assert min(cost.base, cost.per_token, cost.per_attn, cost.per_seq) >= 0
    assert cost.prefill_time(128) > cost.decode_time(1, 16) > 0
    assert len(profile.samples[1]) >= 10
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.step_costs == profile.step_costs and again.cost(4) == cost
    assert profile.hidden_bytes == 64 * 4 and profile.allreduce.bandwidth > 0  # hidden 64, float32
    assert (again.allreduce, again.hidden_bytes) == (profile.allreduce, profile.hidden_bytes)
    assert again.cost(1, tp=2).per_token > cost.per_token / 2  # the all-reduces are not free


def test_a_file_that_is_not_a_profile_is_a_clear_error(tmp_path):
    (tmp_path / "x.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="not a pdserve profile"):
        Profile.load(tmp_path / "x.json")


@pytest.mark.slow
def test_a_profile_counting_attention_the_old_way_is_refused(tiny_model, tmp_path):
    profile = profile_engine(tiny_model, [1], ProfileGrid.quick(), progress=lambda _: None, bar=False)
    data = profile.to_json()
    del data["format"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="profile format 1, this pdserve reads 2"):
        Profile.load(tmp_path / "old.json")


def test_attention_work_is_what_the_engine_kernels_compute():
    from bench.plan.costmodel import decode_keys, prefill_pairs

    # A fresh prompt runs the causal kernel (lower triangle); a chunk after cached
    # tokens runs masked over every key; decodes are padded to the longest of their group.
    assert chunk_attn_pairs(0, 4) == 10
    assert chunk_attn_pairs(4, 6) == 2 * 6
    assert prefill_pairs([(0, 4), (4, 6)]) == 10 + 12
    assert decode_keys([9, 2, 5]) == 3 * 10
    assert decode_keys([63, 63, 2047]) == 2 * 64 + 2048  # the long one in a group of its own
    assert prefill_pairs([]) == decode_keys([]) == 0


def test_fit_recovers_a_separate_cost_for_decode_keys():
    truth = StepCost(base=0.01, per_token=1e-4, per_attn=1e-7, per_seq=5e-4, per_key=2e-6)
    shapes = [(n, chunk_attn_pairs(0, n), 1, 0) for n in (16, 128, 512, 2048)]
    shapes += [(b, 0, b, b * (c + 1)) for b in (1, 8, 24) for c in (64, 384, 2048)]
    samples = [StepSample(n, a, q, truth.step_time(n, a, q, k), k) for n, a, q, k in shapes]
    fitted = fit_step_cost(samples)
    for got, want in zip(astuple(fitted), astuple(truth)):
        assert got == pytest.approx(want, rel=1e-6)
    assert truth.decode_time(4, 2047) == pytest.approx(0.01 + 4e-4 + 2e-3 + 4 * 2048 * 2e-6)


def test_fit_ignores_a_step_slowed_down_by_another_process():
    truth = StepCost(0.004, 2e-4, 3e-8, 1e-3)
    shapes = [(n, chunk_attn_pairs(0, n), 1) for n in (16, 64, 128, 512, 1024, 2048)]
    shapes += [(b, b * (c + 1), b) for b in (1, 4, 8, 32) for c in (64, 512)]
    samples = [StepSample(n, a, s, truth.step_time(n, a, s)) for n, a, s in shapes]
    samples[3] = StepSample(*shapes[3], 5 * truth.step_time(*shapes[3]))
    fit = fit_step_cost(samples)
    assert fit.per_token == pytest.approx(truth.per_token, rel=1e-3)
    assert fit.base == pytest.approx(truth.base, rel=1e-3)


def test_repeated_step_shapes_are_fitted_at_their_median_time():
    from bench.plan.profile import median_by_shape

    samples = [StepSample(10, 55, 1, t) for t in (0.010, 0.011, 0.050)] + [StepSample(1, 20, 1, 0.002)]
    assert sorted(median_by_shape(samples), key=lambda s: s.new_tokens) == [
        StepSample(1, 20, 1, 0.002),
        StepSample(10, 55, 1, 0.011),
    ]


def test_planner_finds_1p1d_carries_a_higher_rate_than_colocated_on_a_prefill_heavy_mix():
    from bench.plan.plan import max_rates
    from bench.plan.sweep import ladder

    profile = fake_profile()
    layouts = [
        (c, build_layout(c, profile, EngineSettings(), Overheads()))
        for c in candidates(2)
        if c.name in ("colocated", "1P1D")
    ]
    workload = Workload.mix(["0.2:1000:8", "0.8:32:32"])
    found = max_rates(layouts, workload, ladder(0.25, 2.0, 6), 60, 5000, 10, 0.9, seed=1)
    colocated, split = found["colocated"], found["1P1D"]
    # Colocated: the more often a 1000-token prefill lands among running decodes, the more
    # requests miss the 10 ms TPOT; 1P1D keeps every TPOT until P cannot keep up.
    assert colocated[0] == 1.0 and colocated[1][2.0] < 0.9
    assert split[0] == 2.0 and split[1][2.0] == 1.0 and split[1][4.0] < 0.9
    assert list(split[1]) == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]


def test_plan_command_answers_the_highest_rate_per_layout(tmp_path, capsys):
    import argparse

    from bench import cli

    path = tmp_path / "profile.json"
    fake_profile().save(path)
    p = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(
        [
            "plan",
            "--profile",
            str(path),
            "--cores",
            "2",
            "--rate",
            "1",
            "--num-requests",
            "30",
            "--layouts",
            "colocated,1p1d",
            "--mix",
            "0.2:1000:8",
            "--mix",
            "0.8:32:32",
            "--slo-ttft-ms",
            "5000",
            "--slo-tpot-ms",
            "10",
            "--max-rate",
            "--json",
            str(tmp_path / "plan.json"),
        ]
    )
    assert args.func(args) == 0
    assert "| layout | highest rate at >= 90% (req/s) |" in capsys.readouterr().out
    data = json.loads((tmp_path / "plan.json").read_text())["max_rate"]
    assert set(data) == {"colocated", "1P1D"} and len(data["1P1D"]["curve"]) == 16
    # 30 requests: colocated misses 90% even at the lowest rung; 1P1D holds up to the 12th (0.25 * 1.25**11).
    assert data["colocated"]["rate"] is None and data["1P1D"]["rate"] == pytest.approx(0.25 * 1.25**11, rel=1e-5)
    # Where 1P1D's attainment falls through 90%: between the 12th rung and the 13th.
    assert 0.25 * 1.25**11 < data["1P1D"]["crossing"] < 0.25 * 1.25**12
    assert data["colocated"]["crossing"] is None


def _plan_command(tmp_path, *extra: str, profile=None):
    import argparse

    from bench import cli

    path = tmp_path / "profile.json"
    (profile or fake_profile()).save(path)
    p = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(
        [
            "plan",
            "--profile",
            str(path),
            "--cores",
            "2",
            "--num-requests",
            "30",
            "--layouts",
            "colocated,1p1d",
            "--mix",
            "0.2:1000:8",
            "--mix",
            "0.8:32:32",
            "--slo-ttft-ms",
            "5000",
            "--json",
            str(tmp_path / "plan.json"),
            *extra,
        ]
    )
    assert args.func(args) == 0
    return json.loads((tmp_path / "plan.json").read_text())


def test_a_rate_no_layout_carries_gets_no_recommendation_but_the_highest_rate_one_does(tmp_path, capsys):
    data = _plan_command(tmp_path, "--rate", "8", "--slo-tpot-ms", "10")
    out = capsys.readouterr().out
    assert data["recommended"] is None and "(recommended)" not in out
    assert "no layout meets the SLO at 8 req/s: the best, 1P1D, has " in out
    # The same ladder as the --max-rate test: 1P1D holds up to its 12th rung, colocated at none.
    assert data["highest_rate_met"] == {"rate": pytest.approx(0.25 * 1.25**11, rel=1e-5), "layout": "1P1D"}
    assert "the highest rate a layout meets it at: 2.91 req/s (1P1D); plan again with --rate 2.91" in out


def test_an_slo_no_layout_meets_at_any_rate_says_so(tmp_path, capsys):
    data = _plan_command(tmp_path, "--rate", "1", "--slo-tpot-ms", "0.001")
    assert data["recommended"] is None and data["highest_rate_met"] is None
    assert "none meets it even at 0.0312 req/s: this SLO is beyond these instances" in capsys.readouterr().out


def test_a_profile_whose_fit_misses_its_samples_is_flagged(tmp_path, capsys):
    import dataclasses

    rough = dataclasses.replace(fake_profile(), fit_errors={1: 0.02, 2: 0.59})
    data = _plan_command(tmp_path, "--rate", "1", "--slo-tpot-ms", "10", profile=rough)
    out = capsys.readouterr().out
    assert "warning: the step-cost fit for 2 thread(s) misses its own samples by 59% on average (bound 15%)" in out
    assert "fit for 1 thread" not in out and len(data["poor_fits"]) == 1
    assert data["recommended"] == "1P1D"


def test_a_split_step_costs_its_compute_over_n_plus_two_all_reduces_a_layer():
    cost = StepCost(base=0.002, per_token=0.001, per_attn=1e-6, per_seq=1e-4, per_key=1e-7)
    allreduce = AllReduceCost(latency=50e-6, bandwidth=1e9)
    two = split_step_cost(cost, 2, allreduce, num_layers=4, hidden_bytes=1000)
    assert two.base == pytest.approx(0.002 + 8 * 50e-6)  # the step's fixed overhead is not split
    assert two.per_token == pytest.approx(0.0005 + 8 * 1000 / 1e9)  # ring of 2: each byte once
    assert (two.per_attn, two.per_seq, two.per_key) == pytest.approx((0.5e-6, 0.5e-4, 0.5e-7))
    four = split_step_cost(cost, 4, allreduce, num_layers=4, hidden_bytes=1000)
    assert four.per_token == pytest.approx(0.00025 + 8 * 1000 * 1.5 / 1e9)  # ring of 4: 2 (N-1)/N
    assert split_step_cost(cost, 1, allreduce, 4, 1000) is cost


def test_tp_candidates_fit_their_ranks_in_the_units_and_their_names_parse():
    names = {c.name: c for c in candidates(3, per_device=True, tp_sizes=(1, 2))}
    assert {"colocated tp2", "2P1D", "1P1D tp2/1", "1P1D tp1/2", "colocated x3"} <= set(names)
    assert "1P1D tp2/2" not in names and "2P1D tp2/1" not in names  # 4 and 5 ranks do not fit 3
    assert names["1P1D tp2/1"] == Candidate(1, 1, 1, 2, 1) == Candidate.parse("1p1d tp2/1", 3, True)
    assert Candidate.parse("colocated tp2", 4, False) == Candidate(0, 1, 2, 1, 2)
    with pytest.raises(ValueError, match="needs 4 instances or ranks; only 3 fit"):
        Candidate.parse("1p1d tp2/2", 3, True)


def test_planner_weighs_one_split_prefill_against_two_by_the_all_reduce_cost():
    # Long prompts at a low rate: TTFT is one prefill; on 2 ranks it is about half, unless the
    # all-reduces cost more than the compute they split.
    workload = Workload.single("1000", "4")

    def ttft(allreduce: AllReduceCost) -> dict[str, float]:
        profile = dataclasses.replace(fake_profile(), hidden_bytes=4096, allreduce=allreduce)
        cands = [Candidate.parse(n, 3, True) for n in ("2p1d", "1p1d tp2/1")]
        layouts = [(c, build_layout(c, profile, EngineSettings(), Overheads())) for c in cands]
        preds = evaluate(layouts, workload, 0.2, 20, None, None, seed=1)
        return {p.candidate.name: p.summary.ttft.p50 for p in preds}

    fast = ttft(AllReduceCost(latency=10e-6, bandwidth=50e9))  # NVLink-like
    assert fast["1P1D tp2/1"] < 0.6 * fast["2P1D"]
    slow = ttft(AllReduceCost(latency=2e-3, bandwidth=0.05e9))  # all-reduces dearer than the split saves
    assert slow["1P1D tp2/1"] > slow["2P1D"]


def test_a_profile_without_an_all_reduce_measurement_refuses_tp_layouts():
    with pytest.raises(ValueError, match="no all-reduce measurement"):
        fake_profile().cost(1, tp=2)
    assert fake_profile().cost(1) == fake_profile().step_costs[1]
