"""bench/micro/background_responses.py on a small run: the stub cluster behind the real router, both modes
measured, every request read to ``response.completed`` (the bench fails otherwise)."""

from __future__ import annotations

import json

import pytest

from bench.micro import background_responses

pytestmark = pytest.mark.integration


def test_the_bench_reports_both_modes_and_their_ratio(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--tokens", "8", "--requests", "4", "--concurrency", "2", "--rounds", "1", "--json", str(out)]
    assert background_responses.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())["summary"]
    assert (summary["store"], summary["tokens"], summary["requests"]) == ("sqlite", 8, 4)
    for mode in ("foreground", "background"):
        assert summary[f"{mode}_requests_per_s"] > 0
        assert 0 < summary[f"{mode}_first_delta_p50_ms"] <= summary[f"{mode}_last_event_p50_ms"]
    assert summary["throughput_ratio"] > 0
