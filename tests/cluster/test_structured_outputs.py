"""Structured outputs and tool calls through the router with the openai SDK, on 1P1D (prefill block
size 4, decode 16: the first token is sampled under the grammar on P, the rest on D) and colocated."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from engine.request import StructuredSpec
from tests.engine.oracle import hf_greedy, hf_masked_greedy
from tests.support.cluster import start_cluster
from tests.support.oracle import PROMPTS, tokenizer
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "population", "sunny"],
    "additionalProperties": False,
}
MESSAGES = [
    {"role": "system", "content": "Answer in JSON."},
    {"role": "user", "content": "What is the capital of France? Numbers: 1 2 3."},
]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def cluster(request, tmp_path_factory, tiny_model):
    if request.param == "1p1d":
        c = request.getfixturevalue("one_p_one_d")
        in_rotation(c)  # so that the first test's prompt goes to the prefill server, not D alone
        yield c
        return
    c = start_cluster(tmp_path_factory, "colocated", tiny_model)
    in_rotation(c)
    yield c
    c.stop()


def in_rotation(c) -> None:
    wait_until(
        lambda: all(w["healthy"] for w in c.http.get(f"{c.router_url}/health").json()["workers"]),
        30,
        "every server in the router's rotation",
    )


def chat_ids(path: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    tok = tokenizer(path)
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def decode(path: str, ids: list[int]) -> str:
    return tokenizer(path).decode(ids, skip_special_tokens=True)


def streamed_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_strict_json_schema_answer_equals_the_masked_oracle_and_validates(served, tiny_model, stream):
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    expected = decode(tiny_model, hf_masked_greedy(tiny_model, chat_ids(tiny_model, MESSAGES), spec, 100))
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    prefilled = served.metric("p0", 'pdserve_requests_total{outcome="ok"}') if "p0" in _names(served) else 0
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=100, temperature=0, response_format=fmt)
    if stream:
        chunks = list(served.client().chat.completions.create(stream=True, **kw))
        text, finish = streamed_text(chunks), chunks[-1].choices[0].finish_reason
    else:
        r = served.client().chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == expected and finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    if "p0" in _names(served):  # the first token was sampled on the prefill server, under the grammar
        assert served.metric("p0", 'pdserve_requests_total{outcome="ok"}') == prefilled + 1


def test_the_sdk_parse_helper_reads_a_json_schema_answer(served):
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        word: str = Field(max_length=6)
        count: int = Field(ge=0, le=999)

    r = served.client().beta.chat.completions.parse(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, response_format=Answer
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Answer) and len(parsed.word) <= 6 and 0 <= parsed.count <= 999


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_object_answer_is_a_json_object(served, stream):
    # Seed 3 closes its object within the budget on this model (a random model's keys run long).
    kw = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=150,
        temperature=1.0,
        seed=3,
        response_format={"type": "json_object"},
    )
    if stream:
        chunks = list(served.client().chat.completions.create(stream=True, **kw))
        text, finish = streamed_text(chunks), chunks[-1].choices[0].finish_reason
    else:
        r = served.client().chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    answer = json.loads(text)
    assert isinstance(answer, dict) and len(answer) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_regex_and_choice_answers_match(served, tiny_model, stream):
    client = served.client()
    prompt = PROMPTS[0]
    for extra, check in (
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,5}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        ({"guided_choice": ["Paris", "Lyon", "Nice"]}, lambda t: t in ("Paris", "Lyon", "Nice")),
    ):
        if stream:
            chunks = list(
                client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=True, extra_body=extra
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, extra_body=extra)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert check(text), text
        assert finish == "stop"
    ids = tokenizer(tiny_model)(prompt)["input_ids"]
    spec = StructuredSpec("choice", json.dumps(["Paris", "Lyon", "Nice"]))
    assert text == decode(tiny_model, hf_masked_greedy(tiny_model, ids, spec, 30))


@pytest.mark.parametrize(
    "body,param,message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "response_format",
            "response_format: the JSON schema does not compile: Invalid type: bogus",
        ),
        ({"guided_regex": "[0-9"}, "guided_regex", "guided_regex: the regular expression does not compile"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one structured output constraint"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only tools of type 'function' are supported"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
            "function.parameters must be a JSON schema of type 'object'",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "the function name 'get_weather' is given twice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
            "tool_choice",
            "tool_choice names the function 'launch', which is not among the tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "only one structured output constraint",
        ),
    ],
)
def test_bad_structured_fields_and_tools_are_refused_with_400_naming_the_problem(served, body, param, message):
    with pytest.raises(openai.BadRequestError) as exc:
        served.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, extra_body=body)
    error = exc.value.body
    assert error["param"] == param and message in error["message"], error


def test_a_server_refuses_a_grammar_that_does_not_compile_whatever_the_router_let_through(served):
    name = "d0" if "d0" in _names(served) else "c0"
    body = {
        "request_id": "bad-grammar",
        "prompt_token_ids": [5, 6, 7],
        "sampling": {"max_tokens": 4, "structured": {"kind": "regex", "value": "[0-9"}},
        "local_prefill": True,
    }
    r = served.http.post(f"{served.server(name)['url']}/generate", json=body)
    assert r.status_code == 400 and "the regular expression does not compile" in r.text


def call_pairs(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_forced_tool_calls_validate_and_stream_as_the_same_deltas(served, choice):
    client = served.client()
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=120,
        temperature=0,
    )
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    ((name, arguments),) = call_pairs(message)
    assert name == "get_time" if isinstance(choice, dict) else name in PARAMETERS
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"
    calls: dict[int, dict] = {}
    finish, fragments = None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or []:
            if d.id is None:  # the first delta of a call has its id and name, the next ones argument text
                fragments += 1
            else:
                assert d.index not in calls and d.function.name and d.type == "function"
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(name, arguments)]
    assert calls[0]["id"].startswith("call_")
    assert fragments > 1  # the arguments streamed as the model wrote them


def test_auto_renders_the_tools_and_a_conversation_with_calls_and_results_is_accepted(served, tiny_model):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    ]
    r = served.client().chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=16, temperature=0
    )
    rendered = [
        messages[0],
        {
            **messages[1],
            "tool_calls": [
                {
                    **messages[1]["tool_calls"][0],
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                }
            ],
        },
        messages[2],
    ]
    ids = chat_ids(tiny_model, rendered, TOOLS)
    assert "<tools>" in tokenizer(tiny_model).decode(ids) and "<tool_response>" in tokenizer(tiny_model).decode(ids)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == decode(tiny_model, hf_greedy(tiny_model, ids, 16))
    assert r.choices[0].message.tool_calls is None


def test_tool_choice_none_renders_no_tools(served, tiny_model):
    messages = [{"role": "user", "content": "Hello"}]
    r = served.client().chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert r.usage.prompt_tokens == len(chat_ids(tiny_model, messages))


def _names(served) -> set[str]:
    return {s["name"] for s in served.servers}
