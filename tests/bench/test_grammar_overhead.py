"""bench/micro/grammar_overhead.py runs both sides and reports per-token times and their ratio."""

from __future__ import annotations

import json

from bench.micro.grammar_overhead import main


def test_grammar_overhead_reports_both_sides_per_token(tiny_model, tmp_path, capsys):
    out = tmp_path / "grammar.json"
    assert (
        main(
            [
                "--model",
                tiny_model,
                "--batch",
                "1,2",
                "--tokens",
                "8",
                "--repeats",
                "1",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["free_tokens"] == 7 * r["batch"]  # max_tokens 8, the first token from the prefill step
        assert 0 < r["grammar_tokens"] <= r["free_tokens"]
        assert abs(r["ratio"] - r["grammar_ms_per_token"] / r["free_ms_per_token"]) < 0.01  # of rounded values
        assert r["mask_only_ms_per_token"] > 0
    assert "grammar ms/tok" in capsys.readouterr().out
