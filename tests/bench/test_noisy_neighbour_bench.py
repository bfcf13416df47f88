"""bench.micro.noisy_neighbour: four phases per stream count, each with its decode steps timed, the busy
loop stopped by its pid, the ratios its rows' quotients."""

from __future__ import annotations

import json

import psutil
import pytest

from bench.micro.noisy_neighbour import main

pytestmark = pytest.mark.integration


def test_each_row_times_every_phase_and_leaves_no_busy_loop(tiny_model, tmp_path):
    out = tmp_path / "rows.json"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert main(["--model", tiny_model, "--threads", "2", "--streams", "1", "--tokens", "12", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    phases = ("quiet", "neighbour_fixed", "neighbour_governed", "quiet_again_governed")
    assert row["streams"] == 1 and all(row[p]["steps"] >= 10 for p in phases)
    assert row["neighbour_fixed"]["threads_at_end"] == 2  # the governor was off
    assert row["fixed_over_quiet"] == round(row["neighbour_fixed"]["p50_ms"] / row["quiet"]["p50_ms"], 2)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
