"""The read-versus-compute rule of decode-to-prefill reuse (prefill_server/pull_rule.py): its decisions
with given figures, and the figures it learns from the engine's prefill steps and from completed reads."""

from __future__ import annotations

import pytest

from prefill_server.pull_rule import ALPHA, PRIOR_BYTES_PER_S, PROBE_EVERY, READ_OVERHEAD_S, PullRule

MB = 1_000_000


def test_before_the_engine_computed_anything_the_read_is_asked_for():
    rule = PullRule()
    assert rule.compute_seconds(100) is None
    assert rule.worth_reading(100, 100 * MB)
    assert rule.read_seconds(4 * MB) == pytest.approx(READ_OVERHEAD_S + 4 * MB / PRIOR_BYTES_PER_S)


def test_a_read_is_asked_for_only_when_computing_its_tokens_takes_at_least_margin_times_as_long():
    rule = PullRule(margin=1.0, bytes_per_s=100 * MB, tokens_per_s=1000.0)
    # 93 tokens of 46 kB: read 5 ms + 43 ms = 48 ms, compute 93 ms
    assert rule.read_seconds(93 * 46_000) == pytest.approx(0.04778)
    assert rule.worth_reading(93, 93 * 46_000)
    # 4 tokens: read 5 ms + 1.8 ms, compute 4 ms
    assert not rule.worth_reading(4, 4 * 46_000)
    assert PullRule(margin=2.0, bytes_per_s=100 * MB, tokens_per_s=1000.0).worth_reading(93, 93 * 46_000) is False
    assert PullRule(margin=0.0, bytes_per_s=1.0, tokens_per_s=1e9).worth_reading(1, 10**9)  # 0: always read


def test_after_probe_every_skips_in_a_row_one_read_is_asked_for_anyway():
    rule = PullRule(bytes_per_s=1 * MB, tokens_per_s=1e6)  # computing is always faster
    decisions = [rule.worth_reading(16, 16 * MB) for _ in range(2 * PROBE_EVERY)]
    assert decisions == ([False] * (PROBE_EVERY - 1) + [True]) * 2
    rule.worth_reading(16, 16 * MB)
    assert rule.skipped == 1
    rule.tokens_per_s = 0.1  # now computing is slow: a read, and the count starts again
    assert rule.worth_reading(16, 16 * MB) and rule.skipped == 0


def test_the_throughput_is_learned_from_what_the_engine_totals_grew_by():
    rule = PullRule()
    rule.observe_engine(600, 0.5)  # first look: 1200 tokens/s since the start
    assert rule.tokens_per_s == 1200.0
    rule.observe_engine(600, 0.5)  # nothing computed since: no sample
    assert rule.tokens_per_s == 1200.0
    rule.observe_engine(700, 1.5)  # 100 tokens in 1 s: a loaded engine
    assert rule.tokens_per_s == pytest.approx(1200 + ALPHA * (100 - 1200))
    assert rule.compute_seconds(100) == pytest.approx(100 / 870)


def test_the_bandwidth_is_learned_from_completed_reads_and_moves_the_decision():
    rule = PullRule(tokens_per_s=1000.0)  # 93 tokens compute in 93 ms
    nbytes = 93 * 46_000
    assert rule.worth_reading(93, nbytes)  # prior: 5 ms + 21 ms
    rule.observe_read(nbytes, 0.405)  # a loaded machine: 400 ms beyond the fixed part
    assert rule.bytes_per_s == pytest.approx(PRIOR_BYTES_PER_S + ALPHA * (nbytes / 0.4 - PRIOR_BYTES_PER_S))
    for _ in range(5):
        rule.observe_read(nbytes, 0.405)
    assert rule.read_seconds(nbytes) > 0.093
    assert not rule.worth_reading(93, nbytes)  # reading now costs more than computing
    for _ in range(10):
        rule.observe_read(nbytes, 0.025)  # the load passed (a probe read saw it)
    assert rule.worth_reading(93, nbytes)


def test_a_read_faster_than_the_fixed_cost_keeps_the_estimate_at_or_above_it():
    rule = PullRule()
    for _ in range(30):
        rule.observe_read(MB, READ_OVERHEAD_S / 2)
    assert READ_OVERHEAD_S <= rule.read_seconds(MB) < READ_OVERHEAD_S * 1.2
    rule.observe_read(0, 1.0)  # nothing read: no sample
    assert rule.read_seconds(MB) < READ_OVERHEAD_S * 1.2
