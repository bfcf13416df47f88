"""Engine behaviour beyond the oracle: remote KV, preemption, seeds, bad input."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, NoCapacityError, SamplingParams
from tests.engine.oracle import hf_greedy
from tests.engine.remote_kv import copy_prompt_kv

PROMPT = [(11 * i) % 400 + 5 for i in range(45)]


def engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_threads", 1)
    kw.setdefault("num_blocks", 64)
    return LLMEngine(EngineConfig(model=path, **kw))


@pytest.mark.parametrize("src_bs,dst_bs,dst_layout", [(16, 32, "NHD"), (64, 16, "NHD"), (1, 16, "NHD"), (16, 8, "HND")])
def test_request_admitted_with_kv_from_another_engine_continues_exactly(tiny_model, src_bs, dst_bs, dst_layout):
    prefill = engine(tiny_model, block_size=src_bs, mode="prefill", num_blocks=128)
    decode = engine(tiny_model, block_size=dst_bs, mode="decode", kv_layout=dst_layout)
    sampling = SamplingParams(max_tokens=12, temperature=0)
    dst_blocks = decode.reserve("r", PROMPT, sampling)
    assert len(dst_blocks) == -(-(len(PROMPT) + 1) // dst_bs)
    prefill.add_request("r", PROMPT, sampling)
    (out,) = prefill.step()
    assert out.finish_reason == "prefilled"
    copy_prompt_kv(prefill, out.block_ids, decode, dst_blocks, len(PROMPT))
    prefill.release("r")
    (first,) = decode.admit_remote("r", out.new_token_ids)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    assert tokens == hf_greedy(tiny_model, PROMPT, 12)
    for e in (prefill, decode):
        e.check_integrity()
        assert e.block_counts() == {"free": e.cache.num_blocks, "reserved": 0, "running": 0}


def test_decode_engine_refuses_a_reservation_it_cannot_hold(tiny_model):
    decode = engine(tiny_model, block_size=16, num_blocks=3, mode="decode")
    decode.reserve("a", PROMPT, SamplingParams(max_tokens=3, temperature=0))  # 45 + 3 tokens: 3 blocks
    with pytest.raises(NoCapacityError):
        decode.reserve("b", [1, 2], SamplingParams(max_tokens=3, temperature=0))
    decode.abort("a")
    assert decode.block_counts() == {"free": 3, "reserved": 0, "running": 0}


@pytest.mark.parametrize("mode", ["colocated", "prefill", "decode"])
def test_a_prompt_the_whole_cache_cannot_hold_is_refused_at_once_and_waits_nowhere(tiny_model, mode):
    # 45 tokens and the first generated one need 3 blocks of 16; the cache has 2. Admitted, it would
    # sit at the head of the queue for good, and every request behind it with it.
    e = engine(tiny_model, block_size=16, num_blocks=2, mode=mode)
    sampling = SamplingParams(max_tokens=4, temperature=0)
    message = (
        "the prompt has 45 tokens; with its first generated token they need 3 KV blocks, and this server's "
        "cache holds 2"
    )
    with pytest.raises(ValueError) as info:
        e.reserve("big", PROMPT, sampling) if mode == "decode" else e.add_request("big", PROMPT, sampling)
    assert str(info.value) == message
    small = PROMPT[:31]  # 32 tokens with the first generated one: exactly the cache
    if mode == "decode":
        assert len(e.reserve("small", small, SamplingParams(max_tokens=1, temperature=0))) == 2
        e.abort("small")
    else:
        e.add_request("small", small, SamplingParams(max_tokens=1, temperature=0))  # one more would need a block
        finished = []
        while not finished:
            finished = [o for o in e.step() if o.finished]
        if mode == "prefill":
            assert finished[0].finish_reason == "prefilled"
            e.release("small")
        else:
            while e.has_unfinished():
                e.step()
    e.check_integrity()
    assert e.block_counts() == {"free": 2, "reserved": 0, "running": 0}


def test_preemption_under_block_pressure_still_gives_exact_tokens(tiny_model):
    prompts = [[(5 * i + k) % 300 + 3 for i in range(20)] for k in range(4)]
    e = engine(tiny_model, block_size=4, num_blocks=24, max_num_batched_tokens=64)
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    preempted = []
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, sampling)
    outputs = {str(i): [] for i in range(len(prompts))}
    while e.has_unfinished():
        plan = e.scheduler.schedule()
        preempted += plan.preempted
        if plan.chunks:
            for o in e.scheduler.update(plan, e.runner.run(plan)):
                outputs[o.request_id] += o.new_token_ids
        e.check_integrity()
    assert preempted, "the scenario must exercise preemption"
    ref = [hf_greedy(tiny_model, p, 16, ignore_eos=True) for p in prompts]
    assert [outputs[str(i)] for i in range(len(prompts))] == ref
    assert e.block_counts() == {"free": 24, "reserved": 0, "running": 0}


def test_step_counters_count_every_computed_token_and_each_preemption(tiny_model):
    prompts = [[(5 * i + k) % 300 + 3 for i in range(20)] for k in range(4)]
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    roomy = engine(tiny_model, block_size=4, max_num_batched_tokens=64)
    roomy.generate(prompts, sampling)
    c = roomy.counters
    # 4 prompts of 20 tokens, then 15 decode steps each (the first token is sampled by the prefill).
    assert (c.prompt_tokens, c.decode_tokens, c.preemptions) == (80, 60, 0)
    # 80 prompt tokens over a 64-token budget: the 4th prompt ends in a step with 3 decodes.
    assert c.steps == {"prefill": 1, "mixed": 1, "decode": 15}
    assert all(v > 0 for v in c.step_seconds.values())
    tight = engine(tiny_model, block_size=4, num_blocks=24, max_num_batched_tokens=64)
    results = tight.generate(prompts, sampling)
    c = tight.counters
    assert c.preemptions >= 1
    assert c.prompt_tokens + c.decode_tokens > 140  # preempted requests were recomputed
    assert [r.token_ids for r in results] == [hf_greedy(tiny_model, p, 16, ignore_eos=True) for p in prompts]


def test_decodes_of_very_different_lengths_run_in_separate_groups_and_stay_exact(tiny_model):
    from engine.attention import decode_groups

    # Sorted context lengths: a new group where one is both twice and 256 longer than the group's first.
    assert decode_groups([5, 9, 200, 250]) == [(0, 4)]
    assert decode_groups([5, 9, 300, 500, 2000]) == [(0, 2), (2, 2), (4, 1)]
    assert decode_groups([]) == []
    prompts = [[(3 * i + k) % 300 + 3 for i in range(n)] for k, n in enumerate((7, 430, 12, 900))]
    e = engine(tiny_model, block_size=16, num_blocks=128, max_num_batched_tokens=2048)
    results = e.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [r.token_ids for r in results] == [hf_greedy(tiny_model, p, 6, ignore_eos=True) for p in prompts]
    assert e.block_counts() == {"free": 128, "reserved": 0, "running": 0}


def test_same_seed_same_text_whatever_the_batch(tiny_model):
    e = engine(tiny_model)
    sampling = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = e.generate([PROMPT], sampling)[0].token_ids
    batched = e.generate([PROMPT[:9], PROMPT, PROMPT[:3]], sampling)[1].token_ids
    other_seed = e.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert alone == batched
    assert other_seed.token_ids != alone


def test_prefill_on_one_engine_and_decode_on_another_samples_like_one_engine(tiny_model):
    sampling = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
    colocated = engine(tiny_model).generate([PROMPT], sampling)[0].token_ids
    prefill = engine(tiny_model, block_size=8, mode="prefill")
    decode = engine(tiny_model, block_size=16, mode="decode")
    blocks = decode.reserve("r", PROMPT, sampling)
    prefill.add_request("r", PROMPT, sampling)
    (out,) = prefill.step()
    copy_prompt_kv(prefill, out.block_ids, decode, blocks, len(PROMPT))
    tokens = decode.admit_remote("r", out.new_token_ids)[0].new_token_ids
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == colocated


def test_greedy_is_argmax_even_with_top_k_and_top_p(tiny_model):
    e = engine(tiny_model)
    greedy = e.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    topk1 = e.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, top_k=1))[0].token_ids
    assert greedy == topk1 == hf_greedy(tiny_model, PROMPT, 8)


@pytest.mark.parametrize(
    "prompt,sampling_kwargs,message",
    [
        ([], {}, "empty"),
        ([10**6], {}, "outside the vocabulary"),
        (list(range(3, 70)), {}, "context holds 64"),
    ],
)
def test_bad_requests_raise_clear_errors(tiny_model, prompt, sampling_kwargs, message):
    e = engine(tiny_model, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        e.add_request("x", prompt, SamplingParams(**sampling_kwargs))
    assert e.block_counts()["free"] == 64


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_bad_sampling_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_engine_config_is_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"block_size\n.*greater than or equal to 1"):
        EngineConfig(model=tiny_model, block_size=0)
    with pytest.raises(ValueError, match=r"block_size\n.*less than or equal to 256"):
        EngineConfig(model=tiny_model, block_size=257)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1}')
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_missing_weights_are_named(tiny_model, tmp_path):
    import shutil

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model}/{f}", tmp_path / f)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
