"""Mixture-of-experts models (engine/moe.py): a Qwen3-MoE layer computes what transformers' computes bit for
bit, an engine on tiny Qwen3-MoE (a dense first layer) and Mixtral models gives transformers' greedy tokens
and log-probabilities, and tensor and expert parallelism over two ranks give one rank's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import check_split, load_config, load_model
from engine.make_model import TinySpec, make_tiny
from engine.moe import MoE, MoESpec
from engine.tensor_parallel import Shard
from tests.engine.oracle import engine_prompt_logprobs, hf_greedy, hf_logits

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (1, 5, 17, 40, 70)]


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    """Qwen3-MoE, 3 layers: the first dense, the others 8 experts, 2 per token."""
    spec = TinySpec(arch="qwen3_moe", layers=3, dense_layers=(0,))
    return str(make_tiny(tmp_path_factory.mktemp("tiny-qwen3-moe"), spec))


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> str:
    return str(make_tiny(tmp_path_factory.mktemp("tiny-mixtral"), TinySpec(arch="mixtral", seed=1)))


def engine_on(path: str, tp: int = 1, ep: int = 1, **knobs) -> LLMEngine:
    base = dict(model=path, block_size=16, num_blocks=96, num_threads=1, max_num_batched_tokens=24)
    return LLMEngine(EngineConfig(**{**base, **knobs}, tensor_parallel_size=tp, expert_parallel_size=ep))


def test_a_layer_of_experts_equals_transformers_bit_for_bit():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True
    )
    torch.manual_seed(0)
    theirs = Qwen3MoeSparseMoeBlock(cfg).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MoE(32, 16, 8, 3, True, range(8), weights_in_model_dtype=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(37, 32)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x[None])[0])


@pytest.mark.parametrize("model", ["tiny_qwen3_moe", "tiny_mixtral"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_tokens_equal_transformers(request, model, block_size):
    path = request.getfixturevalue(model)
    engine = engine_on(path, block_size=block_size, num_blocks=512 // block_size + 32)
    got = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0))]
    assert got == [hf_greedy(path, p, MAX_NEW) for p in PROMPTS]
    engine.check_integrity()
    assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}


@pytest.mark.parametrize("model", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_prompt_logprobs_are_transformers_within_1e_4(request, model):
    path = request.getfixturevalue(model)
    prompt = PROMPTS[-1]
    want = torch.log_softmax(hf_logits(path, prompt), dim=-1)
    expected = [want[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert engine_prompt_logprobs(engine_on(path), prompt) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("ep", [1, 2], ids=["tp2", "tp2-ep2"])
def test_two_ranks_give_one_ranks_tokens_and_logprobs(tiny_qwen3_moe, ep):
    """Tensor parallel splits each expert's features; expert parallel gives each rank 4 of the 8 experts."""
    one = engine_on(tiny_qwen3_moe)
    two = engine_on(tiny_qwen3_moe, tp=2, ep=ep)
    try:
        sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0)
        want = [r.token_ids for r in one.generate(PROMPTS, sampling)]
        assert [r.token_ids for r in two.generate(PROMPTS, sampling)] == want
        assert want == [hf_greedy(tiny_qwen3_moe, p, MAX_NEW) for p in PROMPTS]
        assert engine_prompt_logprobs(two, PROMPTS[-1]) == pytest.approx(
            engine_prompt_logprobs(one, PROMPTS[-1]), abs=1e-4
        )
        two.check_integrity()
        assert two.block_counts() == {"free": 96, "reserved": 0, "running": 0}
    finally:
        two.close()


def test_an_expert_parallel_rank_holds_its_experts_whole(tiny_qwen3_moe):
    cfg = load_config(tiny_qwen3_moe)
    whole, _ = load_model(tiny_qwen3_moe, torch.float32, torch.device("cpu"))
    group = object()  # never called: loading only
    rank1, _ = load_model(tiny_qwen3_moe, torch.float32, torch.device("cpu"), Shard(1, 2, True), group)  # type: ignore[arg-type]
    for layer in (1, 2):
        mine, all_ = rank1.layers[layer].mlp.experts, whole.layers[layer].mlp.experts
        assert torch.equal(mine.gate_up_proj, all_.gate_up_proj[4:])
        assert torch.equal(mine.down_proj, all_.down_proj[4:])
        assert torch.equal(rank1.layers[layer].mlp.gate.weight, whole.layers[layer].mlp.gate.weight)
    assert MoESpec.of(cfg).layers == frozenset({1, 2})


def test_splits_that_do_not_divide_are_refused_by_name(tiny_qwen3_moe, tiny_model, tmp_path):
    six = load_config(str(make_tiny(tmp_path, TinySpec(arch="qwen3_moe", experts=6, moe_intermediate=6))))
    with pytest.raises(ValueError, match="6 experts cannot be split evenly over expert_parallel_size=4"):
        check_split(six, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="each expert's 6 features cannot be split evenly over tensor_parallel_size=4"):
        check_split(six, 4)
    with pytest.raises(ValueError, match="expert_parallel_size > 1 needs a mixture-of-experts model"):
        check_split(load_config(tiny_model), 2, expert_parallel=True)
    with pytest.raises(ValueError, match="expert_parallel_size must be 1 or tensor_parallel_size \\(2\\), got 4"):
        EngineConfig(model=tiny_qwen3_moe, tensor_parallel_size=2, expert_parallel_size=4)


def test_tiny_moe_models_are_saved_as_checkpoints_name_experts(tiny_qwen3_moe, tiny_mixtral, tmp_path):
    with safe_open(f"{tiny_qwen3_moe}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    with safe_open(f"{tiny_mixtral}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.1.block_sparse_moe.experts.3.w2.weight",
    } <= keys
    again = make_tiny(tmp_path / "again", TinySpec(arch="mixtral", seed=1))
    assert (again / "model.safetensors").read_bytes() == open(f"{tiny_mixtral}/model.safetensors", "rb").read()
    assert json.loads((again / "pdserve_model.json").read_text())["arch"] == "mixtral"
