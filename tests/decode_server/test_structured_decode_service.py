"""The decode server and a request's grammar: a first token from a prefill server that the
grammar forbids ends the stream with a clear error, and the blocks are freed."""

from __future__ import annotations

import pytest

from engine.request import SamplingParams, StructuredSpec
from tests.support.scripted import decode_engine, event_lines, run_decode_service
from transfer.outcome import Outcome
from wire.requests import GenerateRequest


@pytest.fixture(scope="module")
def engine(tiny_model):
    return decode_engine(tiny_model)


def constrained(rid: str) -> GenerateRequest:
    spec = StructuredSpec(kind="regex", value="[0-9]+")
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=list(range(10, 16)),
        sampling=SamplingParams(max_tokens=3, temperature=0, structured=spec),
    )


def test_a_first_token_the_grammar_forbids_fails_the_request_clearly(engine):
    letter = engine.tokenizer.convert_tokens_to_ids("x")

    async def scenario(service, receiver):
        first, active = await service.open(constrained("g"))
        receiver.end("t0", Outcome.OK, first_tokens=(letter,))
        lines = await event_lines(service.events(first, active))
        assert len(lines) == 2 and '"code":"bad_notice"' in lines[-1]
        assert f"first token {letter} is not allowed by the request's structured output grammar" in lines[-1]

    run_decode_service(engine, scenario)


def test_a_first_token_the_grammar_allows_continues_under_the_grammar(engine):
    digit = engine.tokenizer.convert_tokens_to_ids("1")

    async def scenario(service, receiver):
        first, active = await service.open(constrained("h"))
        receiver.end("t0", Outcome.OK, first_tokens=(digit,))
        lines = await event_lines(service.events(first, active))
        assert f'"token_ids":[{digit}]' in lines[1]
        tokens = [int(t) for line in lines[1:] for t in line.split('"token_ids":[')[1].split("]")[0].split(",") if t]
        assert engine.tokenizer.decode(tokens, skip_special_tokens=True).isdigit()

    run_decode_service(engine, scenario)
