"""Log-probabilities equal transformers float32's: of every sampled token (the
distribution it was drawn from, over the temperature) and of every prompt token
(the raw model's), computed with the prefill, chunked or not, in a batch."""

from __future__ import annotations

import json

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import LOGPROB_FLOOR, Logprob, StructuredSpec
from tests.engine.oracle import hf_greedy, hf_logits

TOL = 1e-4
PROMPTS = [[(13 * i + 7 * n) % 480 + 3 for i in range(n)] for n in (1, 9, 40, 77)]


def engine(path, chunked=True, **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=path,
            num_threads=1,
            num_blocks=96,
            block_size=16,
            max_num_batched_tokens=24 if chunked else 4096,
            chunked_prefill=chunked,
            **kw,
        )
    )


def run(e: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Every output of every request: tokens, their log-probabilities, the prompt's."""
    for rid, (prompt, sampling) in requests.items():
        e.add_request(rid, prompt, sampling)
    got = {rid: {"tokens": [], "logprobs": [], "prompt": None, "outputs": 0} for rid in requests}
    while e.has_unfinished():
        for out in e.step():
            g = got[out.request_id]
            g["tokens"] += out.new_token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                g["logprobs"] += out.logprobs
            if out.prompt_logprobs is not None:
                assert g["outputs"] == 0, "prompt log-probabilities come with the first output only"
                g["prompt"] = out.prompt_logprobs
            g["outputs"] += 1
    e.check_integrity()
    assert e.block_counts() == {"free": e.cache.num_blocks, "reserved": 0, "running": 0}
    return got


def expected(logprobs: torch.Tensor, token: int, k: int) -> Logprob:
    values, ids = logprobs.topk(k)
    return Logprob(float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist())))


def assert_close(got: Logprob, want: Logprob) -> None:
    assert got.logprob == pytest.approx(want.logprob, abs=TOL)
    assert {t for t, _ in got.top} == {t for t, _ in want.top}
    assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=TOL)
    assert [v for _, v in got.top] == sorted((v for _, v in got.top), reverse=True)  # most likely first


def check_sampled(path, prompt, sampling: SamplingParams, got: dict) -> None:
    """Each output token's log-probabilities against the processed distribution it came from."""
    tokens = got["tokens"]
    logits = hf_logits(path, prompt + tokens)[len(prompt) - 1 : -1]
    temperature = sampling.temperature if not sampling.greedy or sampling.temperature > 0 else 1.0
    assert len(got["logprobs"]) == len(tokens)
    for t, (row, lp) in enumerate(zip(logits, got["logprobs"])):
        assert_close(lp, expected(torch.log_softmax(row / temperature, -1), tokens[t], sampling.logprobs))


def check_prompt(path, prompt, k, entries) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    logprobs = torch.log_softmax(hf_logits(path, prompt), -1)
    for j in range(1, len(prompt)):
        assert_close(entries[j], expected(logprobs[j - 1], prompt[j], k))


@pytest.fixture(scope="module", params=["tiny_model", "tiny_llama_model"])
def model(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "oneshot"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_batched_logprobs_equal_transformers(model, chunked, kind):
    base = dict(temperature=0) if kind == "greedy" else dict(temperature=0.8, top_k=40, top_p=0.9, seed=11)
    requests = {
        "plain": (PROMPTS[2], SamplingParams(max_tokens=6, ignore_eos=True, **base)),
        "top5": (PROMPTS[3], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, **base)),
        "prompt": (PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=3, **base)),
        "both": (PROMPTS[3], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=20, prompt_logprobs=20, **base)),
        "one": (PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2, **base)),
    }
    got = run(engine(model, chunked), requests)
    for rid, (prompt, sampling) in requests.items():
        g = got[rid]
        if sampling.logprobs is None:
            assert g["logprobs"] == []
        else:
            check_sampled(model, prompt, sampling, g)
        if sampling.prompt_logprobs is None:
            assert g["prompt"] is None
        else:
            check_prompt(model, prompt, sampling.prompt_logprobs, g["prompt"])
        if kind == "greedy":
            assert g["tokens"] == hf_greedy(model, prompt, sampling.max_tokens, ignore_eos=True)
    assert got["one"]["prompt"] == [None]
    assert all(len(lp.top) == 20 for lp in got["both"]["logprobs"])
    assert all(lp.top == () for lp in got["prompt"]["logprobs"])


def test_asking_for_logprobs_changes_no_token(tiny_model):
    sampling = dict(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    plain = engine(tiny_model).generate([PROMPTS[2]], SamplingParams(**sampling))[0].token_ids
    got = run(engine(tiny_model), {"r": (PROMPTS[2], SamplingParams(logprobs=3, prompt_logprobs=1, **sampling))})
    assert got["r"]["tokens"] == plain


def test_a_prompt_logprobs_request_computes_its_whole_prompt_despite_the_prefix_cache(tiny_model):
    e = engine(tiny_model)
    prompt = PROMPTS[3]
    e.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # its full blocks are cached now
    computed, queried = e.counters.prompt_tokens, e.counters.prefix_queries_tokens
    got = run(e, {"r": (prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))})
    assert e.counters.prompt_tokens - computed == len(prompt)  # not only the last, uncached block
    assert e.counters.prefix_queries_tokens == queried  # and the cache was not asked
    check_prompt(tiny_model, prompt, 1, got["r"]["prompt"])


def test_bad_logit_bias_is_refused():
    with pytest.raises(ValueError, match="logit_bias.0.1\n  Input should be a finite number"):
        SamplingParams(logit_bias=((5, float("-inf")),))


def test_a_token_of_probability_zero_reports_the_floor_not_minus_infinity(tiny_model):
    """A grammar masks every token but those that spell "ab" or "ba" (and EOS at the end): the others'
    log-probability is -inf, reported as LOGPROB_FLOOR."""
    e = engine(tiny_model)
    spec = StructuredSpec("choice", json.dumps(["ab", "ba"]))
    got = run(e, {"r": (PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, logprobs=5, structured=spec))})
    for lp in got["r"]["logprobs"]:
        allowed = [v for _, v in lp.top if v > LOGPROB_FLOOR]
        assert 1 <= len(allowed) < 5 and [v for _, v in lp.top[len(allowed) :]] == [LOGPROB_FLOOR] * (5 - len(allowed))
        assert sum(torch.tensor(allowed).exp()) == pytest.approx(1.0, abs=TOL)


def test_prompt_logprobs_survive_a_preemption_mid_prompt(tiny_model):
    e = LLMEngine(EngineConfig(model=tiny_model, num_threads=1, num_blocks=12, block_size=4, max_num_batched_tokens=16))
    prompts = [PROMPTS[2], [(5 * i) % 300 + 3 for i in range(30)]]
    requests = {
        str(i): (p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2, logprobs=2))
        for i, p in enumerate(prompts)
    }
    got = run(e, requests)
    assert e.counters.preemptions >= 1, "the scenario must exercise preemption"
    for rid, (prompt, sampling) in requests.items():
        check_prompt(tiny_model, prompt, 2, got[rid]["prompt"])
        check_sampled(tiny_model, prompt, sampling, got[rid])


def test_requests_asking_for_none_of_it_compute_no_log_softmax_and_no_processing(tiny_model, monkeypatch):
    from engine import sampler

    calls = []
    log_softmax, process_rows = torch.log_softmax, sampler.process_rows
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: calls.append("log_softmax") or log_softmax(*a, **k))
    monkeypatch.setattr(sampler, "process_rows", lambda *a: calls.append("process") or process_rows(*a))
    e = engine(tiny_model)
    e.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    e.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.7, seed=1))
    assert calls == []
    e.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0, logprobs=1, repetition_penalty=1.1))
    assert calls == ["process", "log_softmax"]
