"""The simulator on tiny scenarios whose timelines are worked out by hand.

Every step below costs 10 ms + 1 ms per token (no attention or per-sequence
term), so a 100-token prefill takes 110 ms and a one-sequence decode 11 ms.
"""

import pytest

from bench.load.workload import RequestSpec
from bench.plan.costmodel import Overheads, StepCost, TransferCost
from bench.plan.sim_instances import InstanceSpec
from bench.plan.simulate import Layout, simulate

COST = StepCost(base=0.010, per_token=0.001, per_attn=0.0, per_seq=0.0)
INSTANT = TransferCost(bytes_per_token=1, bandwidth=1e18)


def colocated(**kw):
    return Layout("colocated", serving=(InstanceSpec(COST, **kw),))


def pd(transfer=INSTANT, num_p=1, num_d=1, **kw):
    return Layout(
        "1p1d", serving=(InstanceSpec(COST, **kw),) * num_d, prefill=(InstanceSpec(COST),) * num_p, transfer=transfer
    )


def reqs(*lengths):
    return [RequestSpec(i, p, o) for i, (p, o) in enumerate(lengths)]


def times(record):
    return [round(t, 6) for t in record.token_times]


def test_colocated_single_request_prefills_then_decodes():
    result = simulate(colocated(), reqs((100, 3)), [0.0])
    (r,) = result.records
    assert times(r) == [0.110, 0.121, 0.132]
    assert r.ttft == pytest.approx(0.110)
    assert r.tpot == pytest.approx(0.011)
    assert r.e2e == pytest.approx(0.132)
    assert result.utilization == {"C0": pytest.approx(1.0)}


def test_1p1d_first_token_arrives_with_the_kv_after_transfer_latency():
    layout = pd(transfer=TransferCost(bytes_per_token=1, bandwidth=1e18, latency=0.005))
    (r,) = simulate(layout, reqs((100, 3)), [0.0]).records
    assert times(r) == [0.115, 0.126, 0.137]


def test_colocated_long_prefill_stalls_running_decode():
    # A decodes; B's 1000-token prompt joins A's decode in one mixed step of 1.011 s.
    result = simulate(colocated(), reqs((10, 4), (1000, 2)), [0.0, 0.025])
    a, b = result.records
    assert times(a) == [0.020, 0.031, 1.042, 1.054]
    assert a.tpot == pytest.approx((1.054 - 0.020) / 3)
    assert times(b) == [1.042, 1.054]
    assert b.ttft == pytest.approx(1.017)


def test_1p1d_decode_is_not_stalled_by_a_long_prefill():
    a, b = simulate(pd(), reqs((10, 4), (1000, 2)), [0.0, 0.025]).records
    assert times(a) == [0.020, 0.031, 0.042, 0.053]
    assert a.tpot == pytest.approx(0.011)
    assert times(b) == [1.035, 1.046]
    assert b.ttft == pytest.approx(1.010)


def test_simulated_steps_are_counted_by_kind_as_the_engine_counts_them():
    result = simulate(colocated(), reqs((100, 3), (20, 2)), [0.0, 0.115])
    # C0: A's prefill (110 ms); A decodes alone (11 ms); B's prompt joins A's last decode (10 + 21 ms);
    # B decodes alone.
    assert result.steps["C0"] == {
        "prefill": (1, pytest.approx(0.110)),
        "decode": (2, pytest.approx(0.022)),
        "mixed": (1, pytest.approx(0.031)),
    }


def test_prefill_first_policy_runs_a_prefill_only_step_between_decodes():
    layout = colocated(policy="prefill_first")
    a, b = simulate(layout, reqs((10, 3), (100, 1)), [0.0, 0.025]).records
    assert times(a) == [0.020, 0.031, 0.152]
    assert times(b) == [0.141]


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    (r,) = simulate(colocated(max_num_batched_tokens=128), reqs((300, 1)), [0.0]).records
    assert times(r) == [round(0.138 + 0.138 + 0.054, 6)]


def test_prompt_over_budget_without_chunking_runs_alone_budget_by_budget():
    layout = colocated(max_num_batched_tokens=128, chunked_prefill=False)
    a, b = simulate(layout, reqs((300, 1), (10, 1)), [0.0, 0.0]).records
    # 128 + 128 tokens alone (138 ms each), then A's last 44 with B's 10 (64 ms).
    assert times(a) == times(b) == [round(0.138 + 0.138 + 0.064, 6)]


def test_decode_without_free_blocks_queues_the_reservation_until_one_finishes():
    # Each request needs ceil(30 / 16) = 2 blocks; D has 2.
    layout = pd(kv_blocks=2, block_size=16)
    a, b = simulate(layout, reqs((20, 10), (20, 10)), [0.0, 0.0]).records
    assert a.ttft == pytest.approx(0.030)
    assert a.token_times[-1] == pytest.approx(0.030 + 9 * 0.011)
    assert b.ttft == pytest.approx(0.129 + 0.030)


def test_prefill_holds_its_blocks_until_the_kv_reached_decode():
    # P has 2 blocks of 16; a 20-token prompt holds ceil(21 / 16) = 2 until its transfer ends.
    layout = Layout(
        "1p1d",
        serving=(InstanceSpec(COST),),
        prefill=(InstanceSpec(COST, kv_blocks=2),),
        transfer=TransferCost(1, 1e18, latency=0.1),
    )
    a, b = simulate(layout, reqs((20, 1), (20, 1)), [0.0, 0.0]).records
    assert times(a) == [0.130]
    assert times(b) == [0.130 + 0.030 + 0.100]


def test_request_larger_than_the_whole_cache_fails_instead_of_waiting_forever():
    (r,) = simulate(colocated(kv_blocks=1, block_size=16), reqs((20, 10)), [0.0]).records
    assert not r.ok and r.error == "exceeds KV capacity"


def test_short_prompts_under_the_threshold_are_prefilled_on_decode():
    layout = Layout(
        "1p1d",
        serving=(InstanceSpec(COST),),
        prefill=(InstanceSpec(COST),),
        transfer=TransferCost(1, 1e18, latency=0.5),
        local_prefill_below=50,
    )
    short, long_ = simulate(layout, reqs((10, 1), (100, 1)), [0.0, 0.0]).records
    assert times(short) == [0.020]  # on D, no transfer latency
    assert times(long_) == [0.610]  # on P, then 0.5 s transfer


def test_requests_spread_over_two_decode_instances():
    result = simulate(pd(num_d=2), reqs((10, 3), (10, 3)), [0.0, 0.0])
    a, b = result.records
    # P starts on A the moment it arrives, B waits for that 20 ms step;
    # each D then decodes its request alone.
    assert times(a) == [0.020, 0.031, 0.042]
    assert times(b) == [0.040, 0.051, 0.062]
    assert set(result.utilization) == {"P0", "D0", "D1"}


def test_overheads_shift_arrival_and_token_times():
    layout = Layout("c", serving=(InstanceSpec(COST),), overheads=Overheads(ingress=0.002, egress=0.001))
    (r,) = simulate(layout, reqs((100, 2)), [0.0]).records
    assert times(r) == [0.113, 0.124]


def test_layerwise_transfer_hides_all_but_the_last_layer_behind_compute():
    t = TransferCost(bytes_per_token=1000, bandwidth=1e6, num_layers=4)  # 100 tokens: 0.1 s on the wire
    assert t.arrival(100, 0.0, 0.2) == pytest.approx(0.2 + 0.025)  # compute-bound
    assert t.arrival(100, 0.0, 0.04) == pytest.approx(0.01 + 0.1)  # wire-bound
    whole = TransferCost(bytes_per_token=1000, bandwidth=1e6, num_layers=4, layerwise=False)
    assert whole.arrival(100, 0.0, 0.04) == pytest.approx(0.14)


def test_timeline_pipelines_prefill_and_decode_like_the_two_clock_model():
    # Two 500-token prompts with 11 outputs each arrive together.
    co = simulate(colocated(), reqs((500, 11), (500, 11)), [0.0, 0.0])
    dis = simulate(pd(), reqs((500, 11), (500, 11)), [0.0, 0.0])
    # Colocated: A's prefill (0.51 s), then B's prefill rides with A's decode
    # (0.511 s), then 9 shared decode steps of 12 ms and B's last alone.
    a, b = co.records
    assert a.token_times[:2] == [pytest.approx(0.510), pytest.approx(1.021)]
    assert co.duration_s == pytest.approx(1.021 + 9 * 0.012 + 0.011)
    # Disaggregated: P clock 0 -> 0.51 -> 1.02; D decodes A while P works on B.
    a, b = dis.records
    assert times(a) == [round(0.510 + 0.011 * k, 6) for k in range(11)]
    assert b.ttft == pytest.approx(1.020)
    assert dis.duration_s == pytest.approx(1.020 + 10 * 0.011)
    assert dis.utilization["P0"] == pytest.approx(1.020 / dis.duration_s)
    assert dis.utilization["D0"] == pytest.approx(0.220 / dis.duration_s)
