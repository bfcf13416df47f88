"""The router's structured-output and tool fields, without servers: mapping, checks, call parsing."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.structured import GrammarLimits
from router.api.api_requests import ChatCompletionRequest, CompletionRequest
from router.api.grammar_check import GrammarChecker
from router.api.structured import one_constraint
from router.api.tool_calls import ToolCallStream, chat_message, split_calls
from router.api.tools import ToolPlan, plan_tools
from router.errors import OpenAIError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.fixture(scope="module")
def grammars():
    checker = GrammarChecker()
    checker.start()
    yield checker
    checker.close()


def checked_spec(constraints, grammars=None, limits=GrammarLimits()):
    """The one constraint within ``limits``, compiled in ``grammars``' sandbox when given (as the router does)."""
    found = one_constraint(constraints, limits)
    if found is None:
        return None
    if grammars is not None:
        asyncio.run(grammars.check(*found))
    return found[1]


@pytest.mark.parametrize(
    "fields,kind,value",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            "json_schema",
            json.dumps(SCHEMA),
        ),
        ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", '["x", "y"]'),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, "lark", 'start: "a"'),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
        ({"guided_regex": "a|b"}, "regex", "a|b"),
        ({"guided_choice": ["x"]}, "choice", '["x"]'),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "lark", '%llguidance {}\n\nstart: "a"\n     | "b"\n\n'),
    ],
)
def test_each_way_of_asking_for_structured_output_maps_to_one_spec(fields, kind, value):
    for req in (chat(**fields), CompletionRequest(model="tiny", prompt="x", **fields)):
        spec = checked_spec(req.structured_constraints())
        assert (spec.kind, spec.value) == (kind, value)


def test_text_response_format_and_no_fields_mean_no_grammar():
    assert checked_spec(chat(response_format={"type": "text"}).structured_constraints()) is None
    assert checked_spec(chat().structured_constraints()) is None


@pytest.mark.parametrize(
    "fields,param,message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}},
            "response_format",
            "response_format: the JSON schema does not compile: Invalid type: foo",
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "guided_regex: the regular expression does not compile"),
        ({"guided_json": "{nope"}, "guided_json", "guided_json: the JSON schema is not valid JSON"),
        (
            {"structured_outputs": {"grammar": "root ::= ("}},
            "structured_outputs.grammar",
            "structured_outputs.grammar: the grammar is neither Lark nor GBNF",
        ),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "only one structured output constraint per request, got response_format, guided_regex",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "response_format of type json_schema needs a json_schema object",
        ),
    ],
)
def test_a_bad_or_second_constraint_is_a_400_naming_the_parameter(fields, param, message, grammars):
    with pytest.raises(OpenAIError) as exc:
        checked_spec(chat(**fields).structured_constraints(), grammars)
    assert exc.value.status == 400 and exc.value.param == param
    assert exc.value.message.startswith(message)


@pytest.mark.parametrize(
    "tools,choice,param,message",
    [
        ([{"type": "code_interpreter"}], None, "tools[0].type", "only tools of type 'function'"),
        (
            [{"type": "function", "function": {"description": "x"}}],
            None,
            "tools[0].function.name",
            "needs function.name",
        ),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name", "function name 'a b'"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools[0].function.parameters",
            "function.parameters must be a JSON schema of type 'object'",
        ),
        ([TOOL, TOOL], None, "tools[1].function.name", "the function name 'get_weather' is given twice"),
        (
            [TOOL],
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice",
            "tool_choice names the function 'nope'",
        ),
        ([TOOL], "sometimes", "tool_choice", "tool_choice must be"),
        (None, "required", "tool_choice", "tool_choice is only allowed when tools are given"),
        ([TOOL], "auto", "tools", "this model's chat template does not support tools"),
    ],
)
def test_invalid_tools_are_a_400_naming_the_field(tools, choice, param, message):
    template_has_tools = message != "this model's chat template does not support tools"
    with pytest.raises(OpenAIError) as exc:
        plan_tools(tools, choice, template_has_tools)
    assert exc.value.status == 400 and exc.value.param == param
    assert message in exc.value.message


def test_tool_choice_decides_rendering_parsing_and_grammar():
    assert plan_tools([TOOL], "none", True) == ToolPlan()
    auto = plan_tools([TOOL], None, True)
    assert auto.parse and not auto.constraints and auto.tools == [TOOL]
    named = plan_tools([TOOL], {"type": "function", "function": {"name": "get_weather"}}, True)
    ((param, spec),) = named.constraints
    assert param == "tool_choice" and spec.kind == "lark" and '"const": "get_weather"' in spec.value
    assert checked_spec(named.constraints) == spec


def test_calls_are_parsed_out_of_the_answer_with_the_text_around_them():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>'
    )
    content, calls = split_calls(text)
    assert content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("f", "{}"),
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls) and calls[0].id != calls[1].id
    message, reason = chat_message(text, "stop", True)
    assert reason == "tool_calls" and message.tool_calls == calls[:0] + message.tool_calls
    assert chat_message("<tool_call>\nnot json\n</tool_call>", "stop", True)[0].content == (
        "<tool_call>\nnot json\n</tool_call>"
    )
    assert chat_message(text, "stop", False)[0].content == text


STREAMED = (
    'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "<tool"} }\n</tool_call> and '
    '<tool_call>{"arguments": {}, "name": "f"}</tool_call><tool_call>\n{"name": "g", "arguments": {"a": [1'
)


def test_a_streamed_answer_gives_the_same_calls_and_content_in_any_split():
    content, calls = split_calls(STREAMED)
    assert content == "Hi  and"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "<tool"} '),
        ("f", "{}"),
        ("g", '{"a": [1'),
    ]  # the last one was cut short
    for step in (1, 2, 3, 7, len(STREAMED)):
        stream = ToolCallStream()
        pieces = []
        for i in range(0, len(STREAMED), step):
            pieces += stream.feed(STREAMED[i : i + step], i + step >= len(STREAMED))
        assert "".join(p for p in pieces if isinstance(p, str)) == "Hi  and "
        streamed: dict[int, list] = {}
        for p in pieces:
            if not isinstance(p, str):
                (d,) = p.tool_calls
                if d.id is not None:
                    assert d.index not in streamed and d.type == "function" and d.function.arguments == ""
                    streamed[d.index] = [d.function.name, ""]
                streamed[d.index][1] += d.function.arguments
        assert [tuple(v) for v in streamed.values()] == [(c.function.name, c.function.arguments) for c in calls]
        fragments = sum(1 for p in pieces if not isinstance(p, str) and p.tool_calls[0].id is None)
        assert fragments >= (3 if step == len(STREAMED) else 6)  # arguments arrive in pieces
        assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


# ---- through the router app, against a scripted worker and a template without tools ----------------


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    from router.api.model import ServedModel
    from tests.support.fakes import make_byte_tokenizer

    return ServedModel.load("tiny", str(make_byte_tokenizer(tmp_path_factory.mktemp("bytetok"))))


def test_tools_to_a_model_whose_template_has_no_tools_get_400_and_reach_no_server(byte_model):
    from tests.support.fakes import FakeWorkerClient
    from tests.support.router_client import make_client

    assert not byte_model.tools_in_template
    fake = FakeWorkerClient(reply=[104, 105])
    with make_client(byte_model, fake) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]},
        )
        none = c.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [TOOL],
                "tool_choice": "none",
            },
        )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools"
    assert r.json()["error"]["message"] == "this model's chat template does not support tools"
    assert none.status_code == 200  # no tools rendered: nothing the template must support
    assert len(fake.opened) == 1


def test_the_router_sends_the_servers_the_spec_it_checked(byte_model):
    from tests.support.fakes import FakeWorkerClient
    from tests.support.router_client import make_client

    fake = FakeWorkerClient(reply=[49, 50])
    with make_client(byte_model, fake) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "guided_regex": "[0-9]+"})
    assert r.status_code == 200, r.text
    ((_, generate),) = fake.opened
    ((_, prefill),) = fake.prefills
    for sent in (generate, prefill):
        assert (sent.sampling.structured.kind, sent.sampling.structured.value) == ("regex", "[0-9]+")


def test_a_malformed_earlier_tool_call_in_the_conversation_is_a_400(byte_model):
    from tests.support.fakes import FakeWorkerClient
    from tests.support.router_client import make_client

    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": "f"}]},
    ]
    with make_client(byte_model, FakeWorkerClient(reply=[104])) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.1.tool_calls.0.function")
