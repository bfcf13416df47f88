"""What the soak makes of its samples: slopes after warm-up, per-request leftovers, fds and threads over idle."""

from __future__ import annotations

import pytest

from bench.load.soak_mix import parse_mix, request_for
from bench.load.soak_sample import Sample, leftovers, over_idle, slopes


def rss(name: str, pid: int, points: list[tuple[float, float]]) -> list[Sample]:
    return [Sample(t, name, pid, mb, fds=10, threads=5) for t, mb in points]


def test_the_slope_is_fitted_after_warm_up_in_mb_per_hour():
    samples = rss("p0", 1, [(0, 100.0), (60, 400.0), (600, 500.0), (1200, 510.0), (1800, 520.0)])
    (slope,) = slopes(samples, warmup_s=300, bound=5.0)
    assert (slope.mb_per_hour, slope.samples, slope.first_mb, slope.last_mb) == (60.0, 3, 500.0, 520.0)
    assert slope.verdict == "growing"


def test_a_restarted_process_is_fitted_from_its_new_pid_after_its_own_warm_up():
    samples = rss("d0", 1, [(0, 300.0), (100, 900.0)]) + rss("d0", 2, [(200, 50.0), (600, 300.0), (3800, 301.0)])
    (slope,) = slopes(samples, warmup_s=300, bound=5.0)
    assert (slope.pid, slope.samples, slope.verdict) == (2, 2, "too few samples")
    assert slope.mb_per_hour == pytest.approx(1.125, abs=0.01)  # 1 MB in 3200 s


def test_only_per_request_entries_count_as_left_over():
    samples = [
        Sample(0, "p0", 1, 1.0, 1, 1, {"jobs": 0, "timeline_entries": 4096, "aborted_remembered": 12}),
        Sample(0, "d0", 2, 1.0, 1, 1, {"active": 1, "streams": 0, "unreadable": 0}),
        Sample(0, "router", 3, 1.0, 1, 1, {"inflight": 0, "waiting": 2}),
    ]
    assert leftovers(samples) == {"d0": {"active": 1}, "router": {"waiting": 2}}


def test_fds_must_return_to_idle_and_threads_to_what_warm_up_saw_plus_the_slack():
    idle = [Sample(0, "p0", 1, 1.0, fds=30, threads=10)]
    warm = [Sample(60, "p0", 1, 1.0, fds=40, threads=12)]
    assert over_idle([Sample(900, "p0", 1, 1.0, fds=30, threads=14)], idle, warm, thread_slack=2) == {}
    assert over_idle([Sample(900, "p0", 1, 1.0, fds=31, threads=15)], idle, warm, thread_slack=2) == {
        "p0": {"fds": (30, 31), "threads": (12, 15)}
    }
    assert over_idle([Sample(900, "p0", 2, 1.0, fds=99, threads=99)], idle, warm) == {}  # another pid: a restart


def test_a_mix_names_kinds_and_weights_and_each_kind_is_one_request():
    assert parse_mix("chat=3,n4=1") == {"chat": 3.0, "n4": 1.0}
    with pytest.raises(ValueError, match="KIND=WEIGHT"):
        parse_mix("chat=3,embeddings=1")
    path, body = request_for("n4", "hello there", "tiny", 8)
    assert (path, body["n"], body["prompt"], body["max_tokens"]) == ("/v1/completions", 4, "hello there", 8)
    path, body = request_for("json", "hi", "tiny", 8)
    assert (path, body["response_format"]) == ("/v1/chat/completions", {"type": "json_object"})
