"""bench.micro.kv_tiers: one row per prompt length, with the blocks a hit would load, each tier's load
time beside the recompute time, and ratios that are exactly their quotients."""

from __future__ import annotations

import json

import pytest

from bench.micro.kv_tiers import main
from engine.loader import head_dim_of, load_config
from tests.redis_server import RedisServer, missing


def test_each_length_s_row_times_every_tier_and_recomputing(tiny_model, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--model", tiny_model, "--lengths", "40,100", "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    cfg = load_config(tiny_model)
    block_bytes = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head_dim_of(cfg) * 4  # float32
    assert [(r["prompt_tokens"], r["blocks"], r["block_bytes"]) for r in rows] == [
        (40, 2, block_bytes),
        (100, 6, block_bytes),
    ]
    for r in rows:
        for tier in ("host", "disk", "disk_cold"):
            assert r[f"{tier}_ms"] > 0
            assert r[f"{tier}_ratio"] == pytest.approx(r["recompute_ms"] / r[f"{tier}_ms"])
    printed = capsys.readouterr().out
    assert "recompute ms" in printed and printed.count("\n") >= 4


def test_a_length_of_one_block_or_less_is_refused(tiny_model):
    with pytest.raises(SystemExit):
        main(["--model", tiny_model, "--lengths", "16"])


@pytest.mark.skipif(missing() is not None, reason=missing() or "")
def test_with_a_redis_url_the_shared_store_gets_its_own_columns(tiny_model, tmp_path, capsys):
    server = RedisServer()
    try:
        out = tmp_path / "rows.json"
        argv = ["--model", tiny_model, "--lengths", "40", "--rounds", "1", "--redis-url", server.url]
        assert main([*argv, "--json", str(out)]) == 0
        (row,) = json.loads(out.read_text())["rows"]
        assert row["redis_ms"] > 0 and row["redis_ratio"] == pytest.approx(row["recompute_ms"] / row["redis_ms"])
        assert server.client.dbsize() == row["blocks"]
        assert "redis x" in capsys.readouterr().out
    finally:
        server.stop()
