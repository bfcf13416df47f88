"""Metrics math on hand-made timings (seconds in, milliseconds out)."""

import pytest

from bench.load.metrics import RequestRecord, Stats, run_duration, summarize


def records():
    return [
        # ttft 0.1, tpot (0.4 - 0.1) / 2 = 0.15, itl 0.1 and 0.2, e2e 0.4
        RequestRecord(0, 10, 3, start=0.0, end=0.4, token_times=[0.1, 0.2, 0.4], output_tokens=3, ok=True),
        # ttft 0.3, tpot (1.35 - 1.3) / 1 = 0.05, itl 0.05, e2e 0.35
        RequestRecord(1, 20, 2, start=1.0, end=1.35, token_times=[1.3, 1.35], output_tokens=2, ok=True),
        # one token: ttft 0.2, no tpot, no itl, e2e 0.3
        RequestRecord(2, 30, 1, start=0.5, end=0.8, token_times=[0.7], output_tokens=1, ok=True),
        RequestRecord(3, 40, 5, start=0.2, end=0.3, error="HTTP 503"),
    ]


def test_tpot_counts_tokens_not_chunks():
    # Four tokens in two chunks: TPOT spreads end - first token over three gaps.
    r = RequestRecord(0, 5, 4, start=0.0, end=0.7, token_times=[0.1, 0.7], output_tokens=4, ok=True)
    assert r.tpot == pytest.approx(0.2)
    assert r.itls == [pytest.approx(0.6)]


def test_per_request_latencies():
    r0, r1, r2, r3 = records()
    assert (r0.ttft, r0.tpot, r0.e2e) == (pytest.approx(0.1), pytest.approx(0.15), pytest.approx(0.4))
    assert r0.itls == [pytest.approx(0.1), pytest.approx(0.2)]
    assert r2.tpot is None and r2.itls == []
    assert r3.ttft is None and r3.tpot is None and r3.e2e is None and r3.itls == []


def test_percentiles_interpolate_linearly_between_ranks():
    s = Stats.of([0.1, 0.3, 0.2])
    assert (s.count, s.mean, s.p50, s.p90, s.p99, s.max) == (
        3,
        pytest.approx(200),
        pytest.approx(200),
        pytest.approx(280),
        pytest.approx(298),
        pytest.approx(300),
    )
    assert Stats.of([0.001, 0.002, 0.003, 0.004]).p50 == pytest.approx(2.5)
    assert Stats.of([]) == Stats(0, None, None, None, None, None)


def test_summary_aggregates_completed_requests_and_counts_failures():
    s = summarize(records())
    assert s.duration_s == pytest.approx(1.35) == run_duration(records())
    assert (s.num_requests, s.completed, s.failed) == (4, 3, 1)
    assert s.errors == {"HTTP 503": 1}
    assert s.request_throughput == pytest.approx(3 / 1.35)
    assert s.input_token_throughput == pytest.approx(60 / 1.35)
    assert s.output_token_throughput == pytest.approx(6 / 1.35)
    assert s.total_token_throughput == pytest.approx(66 / 1.35)
    assert (s.ttft.mean, s.ttft.p50, s.ttft.p90) == (pytest.approx(200), pytest.approx(200), pytest.approx(280))
    assert (s.tpot.count, s.tpot.mean, s.tpot.p90, s.tpot.p99) == (
        2,
        pytest.approx(100),
        pytest.approx(140),
        pytest.approx(149),
    )
    assert (s.itl.count, s.itl.p50, s.itl.p90) == (3, pytest.approx(100), pytest.approx(180))
    assert (s.e2e.mean, s.e2e.max) == (pytest.approx(350), pytest.approx(400))
    assert s.goodput is None and s.good_requests is None and s.slo_attainment is None


def test_goodput_counts_requests_meeting_both_slos():
    s = summarize(records(), slo_ttft_ms=250, slo_tpot_ms=100)
    # r0 misses TPOT (150 ms), r1 misses TTFT (300 ms), r2 meets both (no TPOT), r3 failed.
    assert s.good_requests == 1
    assert s.goodput == pytest.approx(1 / 1.35)
    assert s.slo_attainment == pytest.approx(0.25)


def test_goodput_with_one_slo_ignores_the_other_metric():
    assert summarize(records(), slo_ttft_ms=250).good_requests == 2
    assert summarize(records(), slo_tpot_ms=100).good_requests == 2
    assert summarize(records(), slo_tpot_ms=150).good_requests == 3


def test_explicit_duration_overrides_first_start_to_last_end():
    s = summarize(records(), duration_s=2.0, slo_ttft_ms=1000)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.goodput == pytest.approx(1.5)


def test_empty_run_summarises_to_zeros():
    s = summarize([])
    assert (s.completed, s.duration_s, s.request_throughput) == (0, 0.0, 0.0)
    assert s.ttft.count == 0


def test_json_has_derived_latencies():
    data = records()[0].to_json()
    assert data["ttft"] == pytest.approx(0.1) and data["tpot"] == pytest.approx(0.15)
    assert summarize(records(), slo_ttft_ms=250).to_json()["slo_attainment"] == pytest.approx(0.5)


def test_the_summary_names_both_slos_of_its_goodput_in_full():
    from bench.load.report import format_summary

    records = [RequestRecord(0, 8, 3, start=0.0, end=0.4, token_times=[0.2, 0.3, 0.4], output_tokens=3, ok=True)]
    text = format_summary(summarize(records, 1.0, slo_ttft_ms=2000, slo_tpot_ms=100))
    lines = text.splitlines()
    goodput = next(i for i, line in enumerate(lines) if line.startswith("Goodput (req/s):"))
    assert lines[goodput].endswith("1.000")
    assert lines[goodput + 1] == "  requests meeting TTFT<=2000ms and TPOT<=100ms"
