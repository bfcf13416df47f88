"""A sequence continued from the tokens it already produced (a request migrated to another
server, ``LLMEngine.add_request(generated=...)``) draws exactly what it would have drawn had it
never moved: greedy, seeded, with penalties, min_tokens, logprobs and a grammar; and bad
continuations are refused before they take anything."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import StructuredSpec
from tests.engine.test_structured import PROMPT, SCHEMA

SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, frequency_penalty=0.4)
CASES = {
    "greedy": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    "seeded": SEEDED,
    "min_tokens": SamplingParams(max_tokens=12, temperature=1.2, seed=7, min_tokens=10),
    "logprobs": SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=3),
    "grammar": SamplingParams(
        max_tokens=60, temperature=0.7, seed=11, structured=StructuredSpec("json_schema", json.dumps(SCHEMA))
    ),
}


def engine(path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, num_threads=1, num_blocks=64))


def run(e: LLMEngine, sampling: SamplingParams, generated: list[int] = (), request_id: str = "r"):
    e.add_request(request_id, PROMPT, sampling, generated=generated)
    tokens, logprobs, reason = [], [], None
    while e.has_unfinished():
        for out in e.step():
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
            reason = out.finish_reason or reason
    return tokens, logprobs, reason


@pytest.mark.parametrize("case", list(CASES))
def test_a_continued_sequence_draws_what_the_uninterrupted_one_drew(tiny_model, case):
    sampling = CASES[case]
    e = engine(tiny_model)
    whole, whole_logprobs, reason = run(e, sampling)
    assert len(whole) >= 3, whole
    if case == "grammar":
        jsonschema.validate(json.loads(e.tokenizer.decode(whole, skip_special_tokens=True)), SCHEMA)
    for k in sorted({1, len(whole) // 2, len(whole) - 1}):
        rest, rest_logprobs, rest_reason = run(e, sampling, whole[:k], f"r{k}")
        assert whole[:k] + rest == whole, (case, k)
        assert rest_reason == reason
        if sampling.logprobs is not None:
            assert [lp.logprob for lp in rest_logprobs] == pytest.approx(
                [lp.logprob for lp in whole_logprobs[k:]], abs=1e-4
            )
            assert [[t for t, _ in lp.top] for lp in rest_logprobs] == [
                [t for t, _ in lp.top] for lp in whole_logprobs[k:]
            ]
    e.check_integrity()
    assert e.block_counts()["free"] == e.scheduler.blocks.num_blocks


def test_sequence_i_of_n_continues_as_one_sequence_seeded_seed_plus_i(tiny_model):
    e = engine(tiny_model)
    n = SamplingParams(max_tokens=8, temperature=1.0, seed=99, n=3)
    e.add_request("all", PROMPT, n)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while e.has_unfinished():
        for out in e.step():
            got[out.index] += out.new_token_ids
    for i, tokens in got.items():
        one = SamplingParams(max_tokens=8, temperature=1.0, seed=99 + i)
        rest, _, _ = run(e, one, tokens[:3], f"s{i}")
        assert tokens[:3] + rest == tokens, i


@pytest.mark.parametrize(
    "sampling,generated,why",
    [
        (SamplingParams(max_tokens=4, n=2, temperature=0), [5], "sampling.n must be 1"),
        (SamplingParams(max_tokens=2, temperature=0), [5, 6], "leave nothing to generate"),
        (SamplingParams(max_tokens=4, temperature=0), [1 << 30], "outside the vocabulary"),
        (SamplingParams(max_tokens=4, temperature=0, stop_token_ids=(5,)), [5, 6], "ends the sequence"),
        (
            SamplingParams(max_tokens=9, temperature=0, structured=StructuredSpec("regex", "[0-9]+")),
            [5],
            "ends the sequence",
        ),
    ],
)
def test_a_continuation_that_cannot_be_is_refused_and_takes_nothing(tiny_model, sampling, generated, why):
    e = engine(tiny_model)
    with pytest.raises(ValueError, match=why):
        e.add_request("bad", PROMPT, sampling, generated=generated)
    assert not e.has_unfinished()
    assert e.block_counts()["free"] == e.scheduler.blocks.num_blocks
