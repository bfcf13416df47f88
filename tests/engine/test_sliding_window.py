"""Sliding-window attention (Mistral's window on every layer, Qwen3's on the layers its layer_types name):
the engine gives transformers' greedy tokens on prompts many windows long, with chunks and cached
prefixes that cross the window, on torch's ops, engine.native's kernels (their windowed layers on torch's
ops) and Triton's kernels (under Triton's interpreter)."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # read by Triton when engine.triton_attention's kernels are defined

import pytest  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.loader import load_config  # noqa: E402
from engine.make_model import TinySpec, make_tiny  # noqa: E402
from engine.model import layer_windows  # noqa: E402
from tests.engine.oracle import hf_greedy  # noqa: E402

WINDOW = 8
PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (1, 7, 9, 30, 70)]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return str(
        make_tiny(tmp_path_factory.mktemp("mistral-swa"), TinySpec(arch="mistral", seed=2, sliding_window=WINDOW))
    )


@pytest.fixture(scope="module")
def qwen3_half_sliding(tmp_path_factory) -> str:
    """A tiny Qwen3 whose second layer slides (use_sliding_window, max_window_layers 1)."""
    path = make_tiny(tmp_path_factory.mktemp("qwen3-swa"), TinySpec(arch="qwen3", seed=4))
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    config.pop("layer_types", None)  # derived again from the three keys above
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_each_layer_gets_its_window(mistral, qwen3_half_sliding, tiny_model):
    assert layer_windows(load_config(mistral)) == [WINDOW, WINDOW]
    assert layer_windows(load_config(qwen3_half_sliding)) == [None, WINDOW]
    assert layer_windows(load_config(tiny_model)) == [None, None]


@pytest.mark.parametrize("model", ["mistral", "qwen3_half_sliding"])
@pytest.mark.parametrize("backend, block_size", [("auto", 16), ("torch", 1), ("triton", 4)])
def test_greedy_tokens_equal_transformers_past_the_window(request, model, backend, block_size):
    path = request.getfixturevalue(model)
    engine = LLMEngine(
        EngineConfig(
            model=path,
            block_size=block_size,
            num_blocks=512 // block_size + 32,
            max_num_batched_tokens=24,  # chunks of a long prompt after a cached part longer than the window
            num_threads=1,
            attention_backend=backend,
        )
    )
    sampling = SamplingParams(max_tokens=12, temperature=0)
    got = [r.token_ids for r in engine.generate(PROMPTS, sampling)]
    shared = PROMPTS[-1][:40] + [5, 6, 7]  # a prefix-cache hit of 32+ tokens, then a new chunk
    got.append(engine.generate([shared], sampling)[0].token_ids)
    want = [hf_greedy(path, p, 12) for p in [*PROMPTS, shared]]
    assert got == want
    engine.check_integrity()
    assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}


def test_the_window_changes_the_answer(mistral, tmp_path):
    """The same weights without the window answer otherwise on a long prompt: the tests above would
    notice a window ignored."""
    plain = make_tiny(tmp_path / "plain", TinySpec(arch="mistral", seed=2, sliding_window=None))
    assert hf_greedy(str(plain), PROMPTS[-1], 12) != hf_greedy(mistral, PROMPTS[-1], 12)


def test_qwen3_moe_with_a_window_is_refused_by_name(tmp_path):
    path = make_tiny(tmp_path / "moe", TinySpec(arch="qwen3_moe"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 8}))
    with pytest.raises(ValueError, match="sliding_window=8 with use_sliding_window in a qwen3_moe config"):
        LLMEngine(EngineConfig(model=str(path), num_blocks=32))
