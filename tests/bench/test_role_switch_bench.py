"""bench.micro.role_switch on a 2P2D mock cluster: two switches under load, no failed request, every
block back, each switch's figures present and in their unit."""

from __future__ import annotations

import json

import pytest

from bench.micro.role_switch import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_switches_under_load_report_their_seconds(tiny_model, tmp_path, capsys):
    out = tmp_path / "switch.json"
    argv = ["--engine", "mock", "--model", tiny_model, "--switches", "2", "--concurrency", "4", "--max-tokens", "8"]
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(s["worker"], s["to"]) for s in result["switches"]] == [("p1", "decode"), ("p1", "prefill")]
    assert all(0 < s["server_seconds"] < s["seconds"] < 30 for s in result["switches"])
    assert result["switch_seconds"]["p50"] <= result["switch_seconds"]["max"]
    assert (result["requests_failed"], result["blocks_back"]) == (0, True) and result["requests_ok"] > 8
    assert json.loads(capsys.readouterr().out) == result


def test_a_layout_that_a_switch_would_empty_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--prefill", "1"])
    assert "must be 2 or more" in capsys.readouterr().err
