"""bench.micro.kv_event_plane: both modes follow every source into the index, and the report's
figures are what its rows say."""

from __future__ import annotations

import json

import pytest

from bench.micro.kv_event_plane import main

pytestmark = pytest.mark.integration


def test_polled_and_pushed_indexes_follow_every_source(tmp_path):
    out = tmp_path / "plane.json"
    argv = ["--workers", "2", "--routers", "1", "--rate", "40", "--seconds", "2", "--warmup", "2", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    poll, push = report["rows"]
    assert (poll["mode"], push["mode"]) == ("poll", "push")
    for row in (poll, push):
        assert row["events_applied"] > 40  # 2 sources x 40/s x 2 s, give or take the edges
        assert row["lag_max_events"] < 40  # within a second of the sources at the end
    assert poll["router_requests"] == poll["pages"] > 0
    assert push["router_requests"] == 0 and push["pages"] > 0  # nothing polled: the streams opened before
    ratio = poll["router_cpu_ms_per_1k_events"] / push["router_cpu_ms_per_1k_events"]
    assert report["router_cpu_per_event_poll_over_push"] == pytest.approx(ratio, rel=0.01)
