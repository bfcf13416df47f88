"""Penalties, logit_bias, min_tokens and stop_token_ids apply to greedy decoding
exactly as a plain reference loop over transformers float32 logits does."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.oracle import hf_greedy, hf_processed_greedy
from tests.engine.remote_kv import copy_prompt_kv

PROMPT = [(17 * i) % 450 + 4 for i in range(37)]
SHORT = [(29 * i) % 300 + 9 for i in range(6)]


def engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 64)
    return LLMEngine(EngineConfig(model=path, num_threads=1, block_size=8, max_num_batched_tokens=16, **kw))


def collect(e: LLMEngine) -> dict[str, dict]:
    got: dict[str, dict] = {}
    while e.has_unfinished():
        for out in e.step():
            g = got.setdefault(out.request_id, {"tokens": [], "logprobs": [], "reason": None})
            g["tokens"] += out.new_token_ids
            g["logprobs"] += out.logprobs or []
            if out.finished:
                g["reason"] = out.finish_reason
    e.check_integrity()
    assert e.block_counts() == {"free": e.cache.num_blocks, "reserved": 0, "running": 0}
    return got


CASES = {
    "repetition": dict(repetition_penalty=3.0),
    "repetition_below_one": dict(repetition_penalty=0.4),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "logit_bias": dict(logit_bias=((11, 6.0), (40, 4.0), (7, -3.0))),
    "combined": dict(
        repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.5, logit_bias=((11, 3.0),), min_tokens=4
    ),
}


def repeating_prompt(model) -> list[int]:
    """PROMPT and what greedy says next: the repetition penalty has something to act on."""
    return PROMPT + hf_greedy(model, PROMPT, 6, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny_model", "tiny_llama_model"])
def model(request):
    return request.getfixturevalue(request.param)


def test_each_processing_and_a_combination_equal_the_reference_batched_with_a_plain_request(model):
    prompt = repeating_prompt(model)
    e = engine(model)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    e.add_request("plain", prompt, plain)
    params = {}
    for name, kw in CASES.items():
        params[name] = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3, **kw)
        e.add_request(name, prompt, params[name])
    got = collect(e)
    greedy = hf_greedy(model, prompt, 16, ignore_eos=True)
    assert got["plain"]["tokens"] == greedy  # the unprocessed row in the same batch stays on the fast path
    for name, p in params.items():
        want, logprobs = hf_processed_greedy(model, prompt, p, e.eos_token_ids)
        assert got[name]["tokens"] == want, name
        assert want != greedy, f"{name} must change the output for this test to mean anything"
        for lp, ref, token in zip(got[name]["logprobs"], logprobs, want):
            assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-4)
            assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_min_tokens_holds_back_an_eos_that_would_come_first(model):
    e = engine(model)
    eos = e.eos_token_ids[0]
    likely_eos = dict(max_tokens=10, temperature=0, logit_bias=((eos, 40.0),))
    e.add_request("eager", SHORT, SamplingParams(**likely_eos))
    e.add_request("held", SHORT, SamplingParams(min_tokens=5, **likely_eos))
    got = collect(e)
    assert got["eager"] == {"tokens": [eos], "logprobs": [], "reason": "stop"}
    want, _ = hf_processed_greedy(model, SHORT, SamplingParams(min_tokens=5, **likely_eos), e.eos_token_ids)
    assert len(want) == 6 and want[-1] == eos and eos not in want[:5]
    assert got["held"]["tokens"] == want and got["held"]["reason"] == "stop"


def test_min_tokens_holds_back_stop_token_ids_too_and_a_stop_token_ends_the_output(model):
    greedy = hf_greedy(model, PROMPT, 10, ignore_eos=True)
    stop = greedy[2]
    first = greedy.index(stop)
    e = engine(model)
    e.add_request("stop", PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(stop,)))
    held = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(stop,), min_tokens=first + 2)
    e.add_request("held", PROMPT, held)
    got = collect(e)
    assert got["stop"]["tokens"] == greedy[: first + 1] and got["stop"]["reason"] == "stop"
    want, _ = hf_processed_greedy(model, PROMPT, held, e.eos_token_ids)
    assert got["held"]["tokens"] == want and stop not in want[: first + 2]


def test_first_token_on_a_prefill_engine_the_rest_on_a_decode_engine_equal_the_reference(model):
    prompt = repeating_prompt(model)
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **CASES["combined"])
    prefill = engine(model, mode="prefill")
    decode = LLMEngine(EngineConfig(model=model, num_threads=1, block_size=16, num_blocks=32, mode="decode"))
    blocks = decode.reserve("r", prompt, p)
    prefill.add_request("r", prompt, p)
    (out,) = [o for _ in range(8) for o in prefill.step()]
    copy_prompt_kv(prefill, out.block_ids, decode, blocks, len(prompt))
    prefill.release("r")
    tokens = [t for o in decode.admit_remote("r", out.new_token_ids) for t in o.new_token_ids]
    tokens += collect(decode)["r"]["tokens"]
    want = hf_processed_greedy(model, prompt, p, decode.eos_token_ids)[0]
    assert tokens == want and want != hf_greedy(model, prompt, 10, ignore_eos=True)
    prefill.check_integrity()
    assert prefill.block_counts()["free"] == prefill.cache.num_blocks


def test_token_ids_outside_the_vocabulary_in_logit_bias_or_stop_token_ids_are_refused(tiny_model):
    e = engine(tiny_model)
    for bad in (dict(logit_bias=((10**6, 1.0),)), dict(stop_token_ids=(10**6,))):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            e.add_request("x", PROMPT, SamplingParams(**bad))
    with pytest.raises(ValueError, match="stop_token_ids.0\n  Input should be greater than or equal to 0"):
        SamplingParams(stop_token_ids=(-1,))  # no token id is negative, whatever the vocabulary
    assert e.block_counts()["free"] == 64


def test_seeded_sampling_with_processing_is_the_same_split_over_two_engines(tiny_model):
    prompt = repeating_prompt(tiny_model)
    p = SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True, **CASES["combined"])
    colocated = engine(tiny_model)
    colocated.add_request("r", prompt, p)
    want = collect(colocated)["r"]["tokens"]
    unprocessed = (
        engine(tiny_model)
        .generate([prompt], SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True))[0]
        .token_ids
    )
    assert want != unprocessed
    prefill, decode = engine(tiny_model, mode="prefill"), engine(tiny_model, mode="decode")
    blocks = decode.reserve("r", prompt, p)
    prefill.add_request("r", prompt, p)
    (out,) = [o for _ in range(8) for o in prefill.step()]
    copy_prompt_kv(prefill, out.block_ids, decode, blocks, len(prompt))
    prefill.release("r")
    tokens = [t for o in decode.admit_remote("r", out.new_token_ids) for t in o.new_token_ids]
    assert tokens + collect(decode)["r"]["tokens"] == want
