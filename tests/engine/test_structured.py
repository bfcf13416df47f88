"""Grammar-constrained generation: exact against a masked transformers oracle, valid output,
the same across a prefill and a decode engine, and bad grammars refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import StructuredSpec
from engine.structured import StructuredOutputs, compile_grammar
from tests.engine.oracle import hf_masked_greedy
from tests.engine.remote_kv import copy_prompt_kv

PROMPT = [(11 * i) % 400 + 5 for i in range(45)]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": StructuredSpec("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredSpec("regex", r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredSpec("choice", json.dumps(["red", "green", "blue"])),
    "lark": StructuredSpec("lark", 'start: "yes" | "no" | NUM\nNUM: /[0-9]{1,3}/'),
}


def engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_threads", 1)
    kw.setdefault("num_blocks", 64)
    return LLMEngine(EngineConfig(model=path, **kw))


def run(e: LLMEngine, prompt: list[int], sampling: SamplingParams, request_id: str = "r"):
    e.add_request(request_id, prompt, sampling)
    tokens, reason = [], None
    while e.has_unfinished():
        for out in e.step():
            tokens += out.new_token_ids
            if out.finished:
                reason = out.finish_reason
    return tokens, reason


def check_output(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    elif kind == "choice":
        assert text in ("red", "green", "blue")
    else:
        assert text in ("yes", "no") or re.fullmatch(r"[0-9]{1,3}", text), text


@pytest.mark.parametrize("kind", list(SPECS))
def test_constrained_greedy_equals_the_masked_oracle_and_matches_the_grammar(tiny_model, kind):
    e = engine(tiny_model)
    sampling = SamplingParams(max_tokens=80, temperature=0, structured=SPECS[kind])
    tokens, reason = run(e, PROMPT, sampling)
    assert tokens == hf_masked_greedy(tiny_model, PROMPT, SPECS[kind], 80)
    assert reason == "stop" and tokens[-1] in e.eos_token_ids
    check_output(kind, e.tokenizer.decode(tokens, skip_special_tokens=True))
    e.check_integrity()
    assert e.block_counts() == {"free": 64, "reserved": 0, "running": 0}


def test_grammar_rows_and_free_rows_in_one_batch_are_each_exact(tiny_model):
    from tests.engine.oracle import hf_greedy

    e = engine(tiny_model)
    prompts = {"json": PROMPT, "free": PROMPT[:20], "regex": PROMPT[5:30]}
    e.add_request(
        "json", prompts["json"], SamplingParams(max_tokens=60, temperature=0, structured=SPECS["json_schema"])
    )
    e.add_request("free", prompts["free"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    e.add_request("regex", prompts["regex"], SamplingParams(max_tokens=20, temperature=0, structured=SPECS["regex"]))
    got = {k: [] for k in prompts}
    while e.has_unfinished():
        for out in e.step():
            got[out.request_id] += out.new_token_ids
    assert got["json"] == hf_masked_greedy(tiny_model, prompts["json"], SPECS["json_schema"], 60)
    assert got["regex"] == hf_masked_greedy(tiny_model, prompts["regex"], SPECS["regex"], 20)
    assert got["free"] == hf_greedy(tiny_model, prompts["free"], 12, ignore_eos=True)


def test_a_complete_grammar_stops_the_request_even_with_ignore_eos(tiny_model):
    e = engine(tiny_model)
    sampling = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, structured=SPECS["choice"])
    tokens, reason = run(e, PROMPT, sampling)
    assert reason == "stop"
    assert e.tokenizer.decode(tokens, skip_special_tokens=True) in ("red", "green", "blue")
    assert tokens[-1] in e.eos_token_ids and len(tokens) < 50


def test_sampled_constrained_output_matches_the_grammar_for_many_seeds(tiny_model):
    e = engine(tiny_model)
    for seed in range(6):
        sampling = SamplingParams(max_tokens=80, temperature=1.5, seed=seed, structured=SPECS["json_schema"])
        tokens, reason = run(e, PROMPT, sampling, f"s{seed}")
        assert reason == "stop"
        check_output("json_schema", e.tokenizer.decode(tokens, skip_special_tokens=True))


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_first_token_on_a_prefill_engine_and_the_rest_on_a_decode_engine_equal_one_engine(tiny_model, kind):
    sampling = SamplingParams(max_tokens=80, temperature=0, structured=SPECS[kind])
    expected, _ = run(engine(tiny_model), PROMPT, sampling)
    prefill = engine(tiny_model, block_size=4, mode="prefill", num_blocks=128)
    decode = engine(tiny_model, block_size=16, mode="decode", kv_layout="HND")
    blocks = decode.reserve("r", PROMPT, sampling)
    prefill.add_request("r", PROMPT, sampling)
    (out,) = prefill.step()
    assert out.finish_reason == "prefilled"
    copy_prompt_kv(prefill, out.block_ids, decode, blocks, len(PROMPT))
    prefill.release("r")
    assert decode.remote_token_problem("r", out.new_token_ids) is None
    (first,) = decode.admit_remote("r", out.new_token_ids)
    tokens = list(first.new_token_ids)
    reason = None
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
            reason = o.finish_reason
    assert tokens == expected and reason == "stop"
    check_output(kind, decode.tokenizer.decode(tokens, skip_special_tokens=True))
    for e in (prefill, decode):
        e.check_integrity()
        assert e.block_counts() == {"free": e.cache.num_blocks, "reserved": 0, "running": 0}


def test_a_remote_first_token_the_grammar_forbids_fails_the_request_and_frees_its_blocks(tiny_model):
    decode = engine(tiny_model, block_size=16, mode="decode")
    decode.reserve("r", PROMPT, SamplingParams(max_tokens=8, temperature=0, structured=SPECS["regex"]))
    letter = decode.tokenizer.convert_tokens_to_ids("x")  # the regex starts with a digit
    assert decode.remote_token_problem("r", [letter]) == (
        f"first token {letter} is not allowed by the request's structured output grammar"
    )
    assert decode.remote_token_problem("r", [10**6]) == "first token 1000000 is outside the vocabulary"
    (out,) = decode.admit_remote("r", [letter])
    assert (out.new_token_ids, out.finished, out.finish_reason) == ([], True, "grammar")
    decode.check_integrity()
    assert decode.block_counts() == {"free": 64, "reserved": 0, "running": 0}


@pytest.mark.parametrize("mode", ["colocated", "decode"])
def test_a_grammar_the_matcher_gives_up_on_ends_the_sequence_as_the_grammars_fault(tiny_model, mode):
    # Every "?" forces another: llguidance's forced-token search passes its item limit on the first
    # token its own mask allowed ("parser too complex"), and the sequence ends with nothing emitted.
    spec = StructuredSpec("lark", 'start: a\na: "?" a')
    question = AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids("?")
    e = engine(tiny_model, block_size=16, mode=mode)
    sampling = SamplingParams(max_tokens=4, temperature=0, structured=spec)
    if mode == "decode":
        e.reserve("r", PROMPT, sampling)
        assert e.remote_token_problem("r", [question]) is None
        outputs = e.admit_remote("r", [question])
    else:
        e.add_request("r", PROMPT, sampling)
        outputs = []
        while e.has_unfinished():
            outputs += e.step()
    assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outputs] == [([], True, "grammar")]
    e.check_integrity()
    assert e.block_counts() == {"free": 64, "reserved": 0, "running": 0}


def test_a_forked_grammar_is_independent(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    outputs = StructuredOutputs(tok, 512, (tok.eos_token_id,))
    red = outputs.grammar(SPECS["choice"])
    assert red.accept(tok.convert_tokens_to_ids("r"))
    blue = red.fork()
    other = outputs.grammar(SPECS["choice"]).fork()
    assert blue.accept(tok.convert_tokens_to_ids("e")) and blue.accept(tok.convert_tokens_to_ids("d"))
    assert not red.allows(tok.eos_token_id) and blue.allows(tok.eos_token_id)
    assert other.allows(tok.convert_tokens_to_ids("g")) and not red.allows(tok.convert_tokens_to_ids("g"))
    assert blue.accept(tok.eos_token_id) and blue.done and not red.done


@pytest.mark.parametrize(
    "spec,message",
    [
        (StructuredSpec("json_schema", '{"type": "foo"}'), "the JSON schema does not compile: Invalid type: foo"),
        (StructuredSpec("json_schema", '{"type": '), "the JSON schema is not valid JSON"),
        (StructuredSpec("json_schema", "[1]"), "the JSON schema must be an object or a boolean"),
        (StructuredSpec("regex", "a(b"), "the regular expression does not compile"),
        (StructuredSpec("choice", "[]"), "the choices must be a non-empty list of non-empty strings"),
        (StructuredSpec("lark", "start: foo"), 'the grammar does not compile: at 1(8): unknown name: "foo"'),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_with_the_problem(tiny_model, spec, message):
    with pytest.raises(ValueError) as exc:
        compile_grammar(spec)
    assert str(exc.value).startswith(message)
    e = engine(tiny_model)
    with pytest.raises(ValueError, match=re.escape(message)):
        e.add_request("bad", PROMPT, SamplingParams(max_tokens=4, structured=spec))
    assert not e.has_unfinished() and e.block_counts()["free"] == 64


def test_an_unknown_grammar_kind_is_refused_where_the_spec_is_made():
    with pytest.raises(ValueError, match="Input should be 'json_schema', 'regex', 'choice' or 'lark'"):
        StructuredSpec("yaml", "x")


def test_preempted_constrained_requests_resume_their_grammar_and_stay_exact(tiny_model):
    prompts = [[(5 * i + k) % 300 + 3 for i in range(20)] for k in range(4)]
    e = engine(tiny_model, block_size=4, num_blocks=24, max_num_batched_tokens=64)
    sampling = SamplingParams(max_tokens=40, temperature=0, structured=SPECS["json_schema"])
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, sampling)
    outputs = {str(i): [] for i in range(len(prompts))}
    preempted = []
    while e.has_unfinished():
        plan = e.scheduler.schedule()
        preempted += plan.preempted
        if plan.chunks:
            for o in e.scheduler.update(plan, e.runner.run(plan)):
                outputs[o.request_id] += o.new_token_ids
        e.check_integrity()
    assert preempted, "the scenario must exercise preemption"
    assert [outputs[str(i)] for i in range(4)] == [
        hf_masked_greedy(tiny_model, p, SPECS["json_schema"], 40) for p in prompts
    ]
    assert e.block_counts() == {"free": 24, "reserved": 0, "running": 0}
