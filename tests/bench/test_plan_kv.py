"""``pdserve plan kv``: the background texts' two examples from their configs (tests/data/), sliding-window
layers bounded by their window, and the engine's own cache size for the models it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.plan.kv import model_kv, read_config
from deploy.cli import main
from engine.kv_cache import KVCache
from engine.loader import head_dim_of, load_config

DATA = Path(__file__).resolve().parents[1] / "data"


def test_llama_3_70b_keeps_320_kib_a_token_and_1_34_gb_for_4k(capsys):
    kv = model_kv(read_config(str(DATA / "llama-3-70b-config.json")))
    assert kv.attention == "grouped-query"
    assert kv.bytes_per_token(2) == 80 * 8 * 128 * 2 * 2 == 320 * 1024
    assert kv.bytes_for(4096, 2) == 1_342_177_280
    assert main(["plan", "kv", "--model", str(DATA / "llama-3-70b-config.json")]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "KV per token         327,680 bytes (320.0 KiB) in bfloat16",
        "KV for 4,096 tokens  1,342,177,280 bytes (1.34 GB)",
    ]


def test_deepseek_v3_keeps_one_latent_a_token_69_kb_and_0_29_gb_for_4k(capsys):
    kv = model_kv(read_config(str(DATA / "deepseek-v3-config.json")))
    assert kv.attention == "latent (MLA)"
    assert kv.bytes_per_token(2) == 61 * (512 + 64) * 2 == 70_272
    assert kv.bytes_for(4096, 2) == 287_834_112
    assert main(["plan", "kv", "--model", str(DATA / "deepseek-v3-config.json")]) == 0
    assert "(0.29 GB)" in capsys.readouterr().out


def test_sliding_window_layers_keep_at_most_their_window():
    """Gemma 3 270M's shape: 18 layers, five sliding (512 tokens) to one global, one KV head of 256."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    cfg = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_size": 640,
        "sliding_window": 512,
        "layer_types": types,
    }
    kv = model_kv(cfg)
    per_layer = 2 * 256 * 2
    assert kv.attention == "grouped-query, 15 of 18 layers sliding"
    assert kv.bytes_per_token(2) == 18 * per_layer
    assert kv.bytes_for(100, 2) == 18 * 100 * per_layer
    assert kv.bytes_for(4096, 2) == (15 * 512 + 3 * 4096) * per_layer
    mistral = model_kv({**cfg, "layer_types": None, "model_type": "mistral"})
    assert mistral.bytes_for(4096, 2) == 18 * 512 * per_layer
    qwen2 = model_kv({**cfg, "layer_types": None, "use_sliding_window": False})
    assert qwen2.bytes_for(4096, 2) == 18 * 4096 * per_layer


@pytest.mark.parametrize("model", ["tiny_model", "tiny_llama_model"])
def test_the_engines_cache_keeps_what_plan_kv_says(request, model):
    path = request.getfixturevalue(model)
    cfg = load_config(path)
    cache = KVCache(
        cfg.num_hidden_layers,
        1,
        16,
        cfg.num_key_value_heads,
        head_dim_of(cfg),
        torch.float32,
        torch.device("cpu"),
        "NHD",
    )
    assert model_kv(read_config(path)).bytes_per_token(4) == cache.bytes_per_token


def test_a_config_without_layers_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4}')
    assert main(["plan", "kv", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "pdserve plan: error: config.json has no 'num_hidden_layers'"
