"""bench.micro.mock_scale on a small cluster: every request answered in full, every block back, each
figure present and in its unit."""

from __future__ import annotations

import json

import pytest

from bench.micro.mock_scale import main

pytestmark = pytest.mark.integration


def test_a_two_by_two_mock_cluster_reports_its_figures(tiny_model, tmp_path, capsys):
    out = tmp_path / "scale.json"
    argv = ["--model", tiny_model, "--prefill", "2", "--decode", "2", "--requests", "24", "--concurrency", "8"]
    assert main([*argv, "--max-tokens", "6", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["servers"] == {"prefill": 2, "decode": 2}
    assert (result["requests"], result["errors"], result["tokens_per_request"]) == (24, 0, [6])
    assert result["blocks_back"] is True and result["servers_used"] == 4
    assert result["requests_per_s"] > 0 and result["router_cpu_ms_per_request"] > 0 and result["start_s"] > 0
    assert 50 < result["rss_mib"]["median"] <= result["rss_mib"]["max"]
    assert 0 < result["pss_mib"]["median"] <= result["pss_mib"]["sum"]
    assert json.loads(capsys.readouterr().out) == result
