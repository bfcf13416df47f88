"""The mock engine (engine/mock.py): the real scheduler and blocks, hashed tokens, profiled step times."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from bench.plan.profile import Profile
from engine.config import EngineConfig
from engine.mock import DEFAULT_STEP_COST, MockEngine, load_step_cost, mock_token, plan_time
from engine.request import SamplingParams, StructuredSpec
from engine.scheduler import ScheduledChunk, SchedulePlan
from engine.step_cost import StepCost

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [42] * 30, [1, 2, 3]]


def mock(model: str, **kw) -> MockEngine:
    return MockEngine(EngineConfig(model=model, kind="mock", num_blocks=64, max_model_len=512, **kw))


def write_profile(path: Path, costs: dict[int, dict]) -> str:
    """A profile as `pdserve plan --save-profile` writes it (bench/plan/profile.py), with these step costs."""
    steps = {t: StepCost(**c) for t, c in costs.items()}
    Profile("tiny", "float32", "cpu", 2, 64, steps, {t: 0.0 for t in costs}, 1e9, 1e-4, "test").save(path)
    return str(path)


def weightless(model: str, folder: Path) -> str:
    """The model folder without its weights: config, generation config and tokenizer."""
    for f in Path(model).iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    return str(folder)


def test_tokens_are_deterministic_full_length_and_never_eos(tiny_model, tmp_path):
    sampling = SamplingParams(max_tokens=40, temperature=0.0)
    a = mock(weightless(tiny_model, tmp_path)).generate(PROMPTS, sampling)
    engine = mock(tiny_model)
    b = engine.generate(PROMPTS, sampling)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [len(r.token_ids) for r in a] == [40, 40, 40]
    assert {r.finish_reason for r in a} == {"length"}
    assert not {t for r in a for t in r.token_ids} & set(engine.eos_token_ids)
    assert len({tuple(r.token_ids) for r in a}) == 3
    vocab = engine.hf_config.vocab_size
    assert all(0 <= t < vocab for r in a for t in r.token_ids)
    assert engine.block_counts() == {"free": 64, "reserved": 0, "running": 0}
    seeded = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=40, seed=7))
    assert seeded[0].token_ids != a[0].token_ids  # the seed is part of the hash


def test_stop_tokens_and_eos_are_never_drawn():
    banned = frozenset(range(0, 511))
    assert {mock_token(t, n, 0, 0, 512, banned) for t in range(20) for n in range(20)} == {511}


def test_a_split_request_continues_as_a_colocated_one(tiny_model):
    """Prefill on one engine, decode on another (reserve, admit_remote): the same tokens as one engine's."""
    sampling = SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=3)
    whole = mock(tiny_model).generate(PROMPTS[:1], sampling)
    prefill, decode = mock(tiny_model, mode="prefill"), mock(tiny_model, mode="decode")
    prefill.add_request("r", PROMPTS[0], sampling)
    first = []
    while prefill.has_unfinished():
        first += [t for out in prefill.step() for t in out.new_token_ids]
    prefill.release("r")
    decode.reserve("r", PROMPTS[0], sampling)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for out in decode.admit_remote("r", first):
        tokens[out.index] += out.new_token_ids
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.index] += out.new_token_ids
    assert [tokens[0], tokens[1]] == [r.token_ids for r in whole]
    assert prefill.block_counts()["free"] == decode.block_counts()["free"] == 64


def test_logprobs_keep_their_shapes(tiny_model):
    engine = mock(tiny_model)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [len(o.logprobs or []) for o in outs] == [1, 1, 1]
    assert all(len(o.logprobs[0].top) == 2 and o.logprobs[0].top[0][0] == o.new_token_ids[0] for o in outs)
    prompt = outs[0].prompt_logprobs
    assert prompt is not None and prompt[0] is None and len(prompt) == len(PROMPTS[0])


def test_structured_outputs_are_refused(tiny_model):
    with pytest.raises(ValueError, match="structured"):
        mock(tiny_model).add_request("r", [1, 2], SamplingParams(structured=StructuredSpec("regex", "[ab]+")))


def test_decode_time_follows_the_profile(tiny_model, tmp_path):
    """N decode steps of one sequence take about N times the profile's modelled step."""
    step = {"base": 0.02, "per_token": 0.0, "per_attn": 0.0, "per_seq": 0.0, "per_key": 0.0}
    profile = write_profile(tmp_path / "p.json", {1: {**step, "base": 1.0}, 2: step})
    engine = mock(tiny_model, mock_profile=profile, num_threads=2)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=26))
    engine.step()  # the prompt and first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    assert engine.counters.decode_tokens == 25
    assert 25 * 0.02 <= elapsed < 25 * 0.02 * 2 + 0.5


def test_plan_time_counts_what_the_cost_model_counts(tiny_model):
    engine = mock(tiny_model)
    engine.add_request("a", list(range(1, 11)), SamplingParams(max_tokens=5))
    engine.step()
    engine.add_request("b", list(range(1, 5)), SamplingParams(max_tokens=5))
    a, b = (engine.scheduler.requests[r][0] for r in "ab")
    plan = SchedulePlan([ScheduledChunk(a, 10, 1, True), ScheduledChunk(b, 0, 4, True)])
    cost = StepCost(base=1.0, per_token=10.0, per_attn=100.0, per_seq=1000.0, per_key=10000.0)
    # 5 new tokens, 4 * 5 / 2 pairs of b's causal prompt, 2 sequences sample, a's decode reads 11 keys
    assert plan_time(cost, plan) == 1 + 10 * 5 + 100 * 10 + 1000 * 2 + 10000 * 11


def test_profile_thread_counts_and_bad_files(tmp_path):
    costs = {t: {"base": t, "per_token": 0, "per_attn": 0, "per_seq": 0, "per_key": 0} for t in (1, 4)}
    path = write_profile(tmp_path / "p.json", costs)
    assert [load_step_cost(path, t).base for t in (None, 1, 3, 4, 16)] == [1, 1, 1, 4, 4]
    (tmp_path / "bad.json").write_text('{"step_costs": {"1": {"base": 1}}}')
    with pytest.raises(ValueError, match="not a pdserve profile"):
        load_step_cost(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="cannot be read"):
        load_step_cost(tmp_path / "none.json")


def test_the_built_in_figures_are_what_the_module_says():
    """A decode of one 512-token sequence about 5 ms, a 512-token prompt about 55 ms."""
    decode = DEFAULT_STEP_COST.step_time(1, 0, 1, 513)
    prefill = DEFAULT_STEP_COST.step_time(512, 512 * 513 // 2, 1)
    assert 0.004 < decode < 0.006 and 0.05 < prefill < 0.06


def test_config_refuses_what_a_mock_cannot_do(tiny_model):
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(model=tiny_model, kind="mock", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kind: mock"):
        EngineConfig(model=tiny_model, mock_profile="p.json")
