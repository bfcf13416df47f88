"""bench.micro.families: one row per family and batch size, the engine's and transformers' tok/s side by
side, and the KV bytes a 1P1D request moves, exactly as the cache geometry and the window rule say."""

from __future__ import annotations

import json

from bench.micro.families import main

KEYS = {
    "family",
    "batch",
    "prompt_len",
    "new_tokens",
    "engine_prefill_tok_s",
    "engine_decode_tok_s",
    "hf_prefill_tok_s",
    "hf_decode_tok_s",
    "prefill_ratio",
    "decode_ratio",
    "kv_bytes_per_token",
    "kv_prompt_len",
    "kv_bytes_moved_per_request",
    "kv_bytes_moved_per_token",
}


def test_each_family_s_row_has_both_sides_and_the_exact_kv_bytes_moved(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["--families", "tiny-swa,tiny-mla", "--batch", "1,2", "--prompt-len", "8", "--new-tokens", "2"]
    argv += ["--rounds", "1", "--kv-prompt-len", "100", "--model-cache", str(tmp_path / "models"), "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["family"], r["batch"]) for r in rows] == [
        ("tiny-swa", 1),
        ("tiny-swa", 2),
        ("tiny-mla", 1),
        ("tiny-mla", 2),
    ]
    for r in rows:
        assert set(r) == KEYS
        assert all(r[k] > 0 for k in KEYS if k.endswith(("tok_s", "ratio")))
    kv = {
        r["family"]: (r["kv_bytes_per_token"], r["kv_bytes_moved_per_request"], r["kv_bytes_moved_per_token"])
        for r in rows
    }
    # tiny-swa: 4 layers x K,V x 2 heads x 16 x 4 B; layers 0, 1, 3 slide over 8 tokens and send the last 7 of 100
    # tiny-mla: 3 layers x a latent of 32 + 8 values x 4 B, every token sent
    assert kv == {"tiny-swa": (1024, (100 + 3 * 7) * 256, 309), "tiny-mla": (480, 100 * 480, 480)}
    table = capsys.readouterr().out
    assert "| family | batch | prefill tok/s | hf prefill | ratio | decode tok/s |" in table
    assert table.count("| tiny-swa |") == 2
