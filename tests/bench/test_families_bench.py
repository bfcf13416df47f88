"""bench.micro.families: one row per family and batch size, the engine's and transformers' tok/s side by
side, and the KV bytes a 1P1D request moves, exactly as the cache geometry and the window rule say."""

from __future__ import annotations

import json

from bench.micro.families import WIDE, main, wide_spec
from bench.peer.families import vllm_folder, vllm_refusal, vllm_rows, with_vllm

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


def test_vllm_reads_a_copy_naming_the_architecture_and_deepseek_s_routing(tmp_path):
    folder = tmp_path / "mla"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": 512}))
    (folder / "model.safetensors").write_bytes(b"weights")
    copy = vllm_folder(folder, tmp_path / "vllm" / "mla")
    config = json.loads((copy / "config.json").read_text())
    assert config == {
        "model_type": "deepseek_v3",
        "vocab_size": 512,
        "architectures": ["DeepseekV3ForCausalLM"],
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    }
    assert (copy / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "deepseek_v3", "vocab_size": 512}


def test_vllm_s_rows_and_refusals_are_set_beside_the_engine_s():
    row = {"batch": 1, "vllm_prefill_tok_s": 200.0, "vllm_decode_tok_s": 40.0, "vllm_tokens": [3, 4]}
    out = f"INFO loading\nROW {json.dumps(row)}\n"
    rows = vllm_rows(out)
    ours = {"batch": 1, "engine_prefill_tok_s": 300.0, "engine_decode_tok_s": 20.0, "engine_tokens": [3, 4]}
    beside = with_vllm(ours, rows[1])
    assert (beside["vllm_prefill_ratio"], beside["vllm_decode_ratio"]) == (1.5, 0.5)
    assert beside["same_tokens_as_vllm"] is True
    assert with_vllm(ours, {**rows[1], "vllm_tokens": [3, 5]})["same_tokens_as_vllm"] is False
    log = "Traceback\n  File x\nRuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2\nbye\n"
    assert vllm_refusal(log) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2"
    assert with_vllm(ours, {"vllm_refused": "no"})["vllm_refused"] == "no"


def test_the_wide_families_keep_their_shapes_with_heads_vllm_s_cpu_attention_takes():
    assert [(wide_spec(f).arch, wide_spec(f).head_dim) for f in WIDE[:3]] == [
        ("qwen3", 64),
        ("qwen3_moe", 64),
        ("gemma3", 64),
    ]
    mla = wide_spec("wide-mla")  # DeepSeek-V3's latent: its cache's "head" is (512 + 64) / 2 values wide
    assert (mla.arch, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.dense_layers) == ("deepseek_v3", 512, 64, (0,))
    assert wide_spec("wide-swa").sliding_window == 8 and wide_spec("wide-moe").dense_layers == (0,)
