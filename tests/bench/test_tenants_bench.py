"""bench.micro.tenants: four phases against stub clusters, each key's counts, and the ratios."""

from __future__ import annotations

import json

import pytest

from bench.micro.tenants import main

pytestmark = pytest.mark.integration


def test_the_four_phases_report_each_key_and_the_limited_heavy_key_is_refused(tmp_path, capsys):
    out = tmp_path / "tenants.json"
    argv = ["--seconds", "3", "--light-rps", "2", "--heavy-x", "4", "--heavy-rpm", "2", "--token-delay", "0.01"]
    argv += ["--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert list(phases) == ["alone", "fifo", "fair", "limited"]
    assert list(phases["alone"]) == ["light"]
    for name in ("fifo", "fair", "limited"):
        assert set(phases[name]) == {"light", "heavy"}
    for name, keys in phases.items():
        for key, stats in keys.items():
            assert stats["errors"] == 0, (name, key, stats)
            assert stats["sent"] == stats["answered"] + sum(stats["refused"].values())
    limited = phases["limited"]["heavy"]
    # A bucket of 2 per minute: the third request and those after it wait 30 s for one more.
    assert limited["refused"]["rate_limit_exceeded"] == limited["sent"] - 2 - limited["refused"].get("overloaded", 0)
    assert min(limited["retry_after_s"]) >= 1
    assert phases["limited"]["light"]["refused"] == {}  # the light key's own limits are untouched
    ratios = report["ratios"]
    assert ratios["light_served_vs_share_fair"] == phases["fair"]["light"]["answered"] / phases["fair"]["light"]["sent"]
    assert ratios["limit_refill_interval_s"] == 30.0
    assert "wrote" in capsys.readouterr().out


def test_some_phases_for_longer_report_the_ratios_they_have(tmp_path):
    out = tmp_path / "tenants.json"
    phases = ["--phases", "fair,alone,queued"]
    argv = [*phases, "--seconds", "3", "--light-rps", "2", "--heavy-x", "4", "--token-delay", "0.01", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert list(report["phases"]) == ["alone", "queued", "fair"]  # in the bench's order
    ratios = report["ratios"]
    assert set(ratios) == {f"{r}_{kind}" for r in RATIOS for kind in ("queued", "fair")}
    for kind in ("queued", "fair"):
        assert ratios[f"heavy_answered_per_s_{kind}"] == report["phases"][kind]["heavy"]["answered_per_s"]
        assert report["phases"][kind]["heavy"]["errors"] == 0


RATIOS = ("light_p99_ttft_vs_alone", "light_served_vs_share", "heavy_answered_per_s")
