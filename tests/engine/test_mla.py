"""DeepSeek-V3's layout (engine/mla.py, engine/moe.py): latent attention over a cache of one latent per token and
layer, decoded in the absorbed form, and DeepSeek's router and shared experts. On tiny random models (the
built-in tiny-mla: q_lora, interleaved RoPE under YaRN, a dense first layer then experts; and one with a
plain q_proj, default RoPE, RoPE not interleaved) the engine gives transformers' greedy tokens and
log-probabilities, through prefix-cache hits, chunked prefill, preemption, both cache orders and two ranks."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors import safe_open

from bench.plan.kv import model_kv, read_config
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import load_config
from engine.make_model import TINY_MLA, make_tiny
from engine.moe import MoE, MoESpec
from engine.tensor_parallel import Shard
from tests.engine.oracle import engine_prompt_logprobs, hf_greedy, hf_logits
from tests.engine.remote_kv import copy_prompt_kv

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (1, 5, 17, 40, 70)]
SAMPLING = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="session")
def tiny_mla(tmp_path_factory) -> str:
    return str(make_tiny(tmp_path_factory.mktemp("tiny-mla"), TINY_MLA))


@pytest.fixture(scope="session")
def tiny_mla_plain_q(tmp_path_factory) -> str:
    """One q_proj (q_lora_rank None), RoPE neither interleaved nor scaled."""
    path = make_tiny(tmp_path_factory.mktemp("tiny-mla-q"), dataclasses.replace(TINY_MLA, seed=1, q_lora_rank=None))
    config = json.loads((path / "config.json").read_text())
    plain = {"rope_type": "default", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps({**config, "rope_interleave": False, "rope_parameters": plain}))
    return str(path)


def engine_on(path: str, **knobs) -> LLMEngine:
    base = dict(model=path, block_size=16, num_blocks=96, num_threads=1, max_num_batched_tokens=24)
    return LLMEngine(EngineConfig(**{**base, **knobs}))


def greedy(path: str, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    return [hf_greedy(path, p, max_new, ignore_eos=True) for p in prompts]


def test_the_cache_holds_one_latent_a_token_and_layer_as_plan_kv_counts(tiny_mla):
    """kv_lora_rank 32 + qk_rope_head_dim 8: one head of 20 values in each plane, 3 x 40 x 4 bytes a token."""
    engine = engine_on(tiny_mla, kv_cache_bytes=3 * 40 * 4 * 16 * 10, num_blocks=None)
    assert engine.cache.kv.shape == (3, 2, 10, 16, 1, 20)
    assert engine.cache.bytes_per_token == 3 * (32 + 8) * 4 == model_kv(read_config(tiny_mla)).bytes_per_token(4)
    assert (engine.cache.num_kv_heads_total, engine.cache.head_ids) == (1, (0,))


@pytest.mark.parametrize("model", ["tiny_mla", "tiny_mla_plain_q"])
@pytest.mark.parametrize("block_size, layout", [(1, "NHD"), (16, "NHD"), (4, "HND")])
def test_greedy_tokens_equal_transformers(request, model, block_size, layout):
    """Prompts of 1 to 70 tokens in chunks of at most 24 tokens, then a prompt whose first 40 tokens are cached."""
    path = request.getfixturevalue(model)
    engine = engine_on(path, block_size=block_size, num_blocks=512 // block_size + 32, kv_layout=layout)
    got = [r.token_ids for r in engine.generate(PROMPTS, SAMPLING)]
    shared = PROMPTS[-1][:40] + [5, 6, 7]
    got.append(engine.generate([shared], SAMPLING)[0].token_ids)
    assert engine.stats().counters.prefix_hits_tokens == 40 // block_size * block_size
    assert got == greedy(path, [*PROMPTS, shared])
    engine.check_integrity()
    assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}


@pytest.mark.parametrize("model", ["tiny_mla", "tiny_mla_plain_q"])
def test_prompt_logprobs_are_transformers_within_1e_4(request, model):
    path = request.getfixturevalue(model)
    prompt = PROMPTS[-1]
    want = torch.log_softmax(hf_logits(path, prompt), dim=-1)
    expected = [want[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert engine_prompt_logprobs(engine_on(path), prompt) == pytest.approx(expected, abs=1e-4)


def test_preemption_with_a_shared_prefix_stays_exact(tiny_mla):
    base = PROMPTS[-1][:16]
    prompts = [base + [(11 * i + k) % 400 + 30 for i in range(6)] for k in range(4)]
    engine = engine_on(tiny_mla, block_size=4, num_blocks=20, max_num_batched_tokens=64)
    results = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    counters = engine.stats().counters
    assert counters.preemptions > 0 and counters.prefix_hits_tokens > 0
    assert [r.token_ids for r in results] == greedy(tiny_mla, prompts, 16)
    engine.check_integrity()
    assert engine.block_counts() == {"free": 20, "reserved": 0, "running": 0}


def test_a_decode_engine_continues_from_latents_copied_as_a_transfer_places_them(tiny_mla):
    """Prefill's blocks of 16 tokens (NHD) into decode's blocks of 4 (HND), token by token, both planes of a latent."""
    prompt = PROMPTS[-1]
    prefill = engine_on(tiny_mla, mode="prefill")
    decode = engine_on(tiny_mla, block_size=4, num_blocks=64, mode="decode", kv_layout="HND")
    blocks = decode.reserve("r", prompt, SAMPLING)
    prefill.add_request("r", prompt, SAMPLING)
    outs: list = []
    while not outs:  # chunks of 24 tokens
        outs = prefill.step()
    (out,) = outs
    assert out.finish_reason == "prefilled"
    copy_prompt_kv(prefill, out.block_ids, decode, blocks, len(prompt))
    prefill.release("r")
    (first,) = decode.admit_remote("r", out.new_token_ids)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == greedy(tiny_mla, [prompt])[0]
    for e in (prefill, decode):
        e.check_integrity()
        assert e.block_counts() == {"free": e.cache.num_blocks, "reserved": 0, "running": 0}


@pytest.mark.parametrize("ep", [1, 2], ids=["tp2", "tp2-ep2"])
def test_two_ranks_give_one_ranks_tokens_and_logprobs(tiny_mla, ep):
    """Each rank holds 2 of the 4 query heads and the whole latent; the experts split by features or whole."""
    one = engine_on(tiny_mla)
    two = engine_on(tiny_mla, tensor_parallel_size=2, expert_parallel_size=ep)
    try:
        want = [r.token_ids for r in one.generate(PROMPTS, SAMPLING)]
        assert [r.token_ids for r in two.generate(PROMPTS, SAMPLING)] == want
        assert engine_prompt_logprobs(two, PROMPTS[-1]) == pytest.approx(
            engine_prompt_logprobs(one, PROMPTS[-1]), abs=1e-4
        )
        two.check_integrity()
        assert two.block_counts() == {"free": 96, "reserved": 0, "running": 0}
    finally:
        two.close()


def test_deepseek_experts_equal_transformers_bit_for_bit():
    """Sigmoid scores with the correction bias, 2 of 4 groups, top 3 of their experts renormalised and scaled,
    plus the shared experts."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from engine.model import MLP

    cfg = DeepseekV3Config(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_hidden_layers=1,
        first_k_dense_replace=0,
    )
    torch.manual_seed(0)
    theirs = DeepseekV3MoE(cfg).eval()
    for p in [*theirs.parameters(), *theirs.buffers()]:
        torch.nn.init.normal_(p, std=0.3)
    spec = MoESpec.of(cfg)
    assert spec is not None and spec.shared_intermediate == 32
    ours = MoE(32, 16, 8, 3, True, range(8), False, spec.routing, MLP(32, 32))
    state = theirs.state_dict()
    shared = {k: v for k, v in state.items() if k.startswith("shared_experts.")}
    gate_up = torch.cat([shared["shared_experts.gate_proj.weight"], shared["shared_experts.up_proj.weight"]])
    state = {k: v for k, v in state.items() if k not in shared}
    state |= {"shared_experts.gate_up_proj.weight": gate_up}
    state |= {"shared_experts.down_proj.weight": shared["shared_experts.down_proj.weight"]}
    ours.load_state_dict(state)
    x = torch.randn(37, 32)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x[None])[0])


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "rope_parameters",
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            "rope_parameters.rope_type='linear'",
        ),
        ("scoring_func", "softmax", "scoring_func='softmax' in a deepseek_v3 config is not supported"),
        ("n_group", 3, "n_group=3 in a deepseek_v3 config is not supported"),
        ("qk_rope_head_dim", 7, "kv_lora_rank=32 with qk_rope_head_dim=7"),
        ("num_key_value_heads", 2, "num_key_value_heads=2 in a deepseek_v3 config is not supported"),
        ("hidden_act", "gelu", "hidden_act='gelu' in a deepseek_v3 config is not supported"),
    ],
)
def test_what_the_engine_would_not_compute_is_refused_by_name(tiny_mla, tmp_path, field, value, message):
    config = {**read_config(tiny_mla), field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).symlink_to(f"{tiny_mla}/{name}")
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMEngine(EngineConfig(model=str(tmp_path), num_blocks=8))


def test_tiny_mla_is_deterministic_and_saved_as_checkpoints_name_experts(tiny_mla, tmp_path):
    with safe_open(f"{tiny_mla}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.shared_experts.up_proj.weight",
        "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
    } <= keys
    assert MoESpec.of(load_config(tiny_mla)).layers == frozenset({1, 2})  # type: ignore[union-attr]
    again = make_tiny(tmp_path / "again", TINY_MLA)
    assert (again / "model.safetensors").read_bytes() == open(f"{tiny_mla}/model.safetensors", "rb").read()


def test_a_rank_holds_its_query_heads_and_the_whole_latent(tiny_mla):
    from engine.loader import load_model

    whole, _ = load_model(tiny_mla, torch.float32, torch.device("cpu"))
    rank1, _ = load_model(tiny_mla, torch.float32, torch.device("cpu"), Shard(1, 2), object())  # type: ignore[arg-type]
    mine, all_ = rank1.layers[1].self_attn, whole.layers[1].self_attn
    assert mine.num_heads == 2
    assert torch.equal(mine.q_b_proj.weight, all_.q_b_proj.weight[48:])  # heads 2, 3 of 24 rows each
    assert torch.equal(mine.kv_b_proj.weight, all_.kv_b_proj.weight[64:])  # heads 2, 3 of 16 + 16 rows
    assert torch.equal(mine.o_proj.weight, all_.o_proj.weight[:, 32:])
    assert torch.equal(mine.kv_a_proj_with_mqa.weight, all_.kv_a_proj_with_mqa.weight)
