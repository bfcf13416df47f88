"""A short soak: a steady mix of every kind of request through 1P1D, then nothing left behind.

Once the load stops, every per-request entry on every server and the router's in-flight gauges go
back to 0, and each process's open fds go back to their idle numbers, taken after a priming load
(the first requests open what is kept open for good: the prefill server's connection to the decode
server), its threads to those or to what half-way through the load had, plus a slack of 2 (worker
pools grow on a burst and keep their threads; a thread per request would pass that within seconds).
The bounded maps stay within their bounds. The long version, with RSS slopes, is
``python -m bench.load.soak`` (bench/README.md, "Memory under a steady load").
"""

from __future__ import annotations

import time

import pytest

from bench.load.soak_mix import DEFAULT_MIX, MixLoad, parse_mix
from bench.load.soak_sample import sample, settle
from prefill_server.service import REMEMBER_ABORTED
from tests.support.cluster import Cluster, make_config
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TIMELINE = 512  # each server's log of recent requests (GET /debug/timeline) kept this short, and
REQUESTS = 1500  # past it several times over: under a minute on 2 cores
SETTLE_S = 60.0


def start(cluster: Cluster, clients: int, seed: int) -> MixLoad:
    mix = MixLoad(cluster.router_url, "tiny", parse_mix(DEFAULT_MIX), clients, max_words=120, seed=seed)
    mix.start()
    return mix


def until_answered(mix: MixLoad, requests: int) -> None:
    wait_until(lambda: mix.tally.total() >= requests, timeout=600, what=f"{requests} requests answered")


def test_after_a_steady_mix_no_request_is_left_and_fds_and_threads_are_back_to_idle(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cluster = Cluster(make_config(tmp_path, "tiny-1p1d", tiny_model, {"timeline_entries": TIMELINE}), run_dir)
    try:
        headers = dict(cluster.http.headers)
        t0 = time.monotonic()
        primer = start(cluster, 3, seed=1)
        try:
            until_answered(primer, 60)
        finally:
            primer.stop()
        assert primer.tally.errors() == 0, (primer.tally.counts, primer.tally.details)
        idle, left, _ = settle(run_dir, cluster.http, headers, [], t0, SETTLE_S)
        assert left == {}
        assert {s.name for s in idle} == {"router", "p0", "d0"}

        soak = start(cluster, 3, seed=2)
        try:
            until_answered(soak, REQUESTS // 2)
            # Worker pools may grow to their size while the load warms up; a thread per request would not stop.
            warm = sample(run_dir, cluster.http, headers, time.monotonic() - t0)
            until_answered(soak, REQUESTS)
        finally:
            soak.stop()
        final, left, over = settle(run_dir, cluster.http, headers, idle, t0, SETTLE_S, warm)

        assert soak.tally.errors() == 0, (soak.tally.counts, soak.tally.details)
        assert {kind for kind, _ in soak.tally.counts} == set(parse_mix(DEFAULT_MIX))  # every kind was sent
        assert left == {}, f"per-request bookkeeping left after the load: {left}"
        assert over == {}, f"fds or threads above idle (idle, now): {over}"
        book = {s.name: s.book for s in final}
        assert "jobs" in book["p0"] and "active" in book["d0"] and "inflight" in book["router"]  # all read
        assert book["p0"]["aborted_remembered"] <= REMEMBER_ABORTED
        assert book["d0"]["timeline_entries"] == TIMELINE  # every request went through d0
        assert book["p0"]["timeline_entries"] <= TIMELINE
        assert [s.pid for s in final] == [s.pid for s in idle]  # nothing restarted
    finally:
        cluster.stop()
