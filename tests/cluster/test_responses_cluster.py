"""/v1/responses on real clusters (1P1D, colocated) with the openai SDK: a conversation chained by
previous_response_id answers exactly what transformers answers to the same messages."""

from __future__ import annotations

import json
import os
import signal

import jsonschema
import pytest

from tests.engine.oracle import hf_greedy
from tests.support.cluster import start_cluster
from tests.support.oracle import tokenizer
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TURNS = ["What is the capital of France?", "And of Italy?", "Name a river in either."]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def served(request, tmp_path_factory, tiny_model):
    if request.param == "1p1d":
        c = request.getfixturevalue("one_p_one_d")
    else:
        c = start_cluster(tmp_path_factory, "colocated", tiny_model)
    wait_until(
        lambda: all(w["healthy"] for w in c.http.get(f"{c.router_url}/health").json()["workers"]),
        30,
        "every server in the router's rotation",
    )
    yield c
    if request.param != "1p1d":
        c.stop()


def greedy_answer(path: str, messages: list[dict]) -> str:
    tok = tokenizer(path)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    return tok.decode(hf_greedy(path, prompt, MAX_TOKENS), skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_three_turn_conversation_by_previous_response_id_equals_transformers(served, tiny_model, stream):
    client = served.client()
    messages: list[dict] = [{"role": "system", "content": "You are terse."}]
    previous = None
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        made = client.responses.create(
            model="tiny",
            input=turn,
            instructions="You are terse." if previous is None else None,
            previous_response_id=previous,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            stream=stream,
        )
        if stream:
            events = list(made)
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            made = events[-1].response
            assert made.output_text == deltas
        expected = greedy_answer(tiny_model, messages if previous is None else messages[1:])
        assert made.output_text == expected, turn
        messages.append({"role": "assistant", "content": made.output_text})
        previous = made.id
    stored = client.responses.retrieve(previous)
    assert stored.output_text == messages[-1]["content"]
    assert [i.content[0].text for i in client.responses.input_items.list(previous).data] == [TURNS[-1]]
    assert served.wait_idle() >= 0
    assert all(b["free"] == b["total"] for b in served.blocks().values())


def test_stored_responses_survive_a_router_killed_and_restarted_by_the_launcher(tmp_path_factory, tiny_model):
    c = start_cluster(tmp_path_factory, "colocated", tiny_model)
    try:
        client = c.client()
        made = client.responses.create(model="tiny", input=TURNS[0], max_output_tokens=MAX_TOKENS, temperature=0)
        assert (c.run_dir / "responses.sqlite").is_file()
        router = next(p for p in c.manifest["processes"] if p["role"] == "router")
        os.kill(router["pid"], signal.SIGKILL)

        def restarted() -> bool:
            path = c.run_dir / "restarts.json"
            done = json.loads(path.read_text())["restarts"] if path.exists() else []
            return any(r["name"] == "router" and r["back_after_s"] is not None for r in done)

        wait_until(restarted, 60, "the launcher restarted the router")
        assert client.responses.retrieve(made.id).output_text == made.output_text
        follow = client.responses.create(
            model="tiny", input=TURNS[1], previous_response_id=made.id, max_output_tokens=MAX_TOKENS, temperature=0
        )
        messages = [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": made.output_text}]
        assert follow.output_text == greedy_answer(tiny_model, [*messages, {"role": "user", "content": TURNS[1]}])
    finally:
        c.stop()


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}


def test_a_forced_function_call_round_trip_matches_its_schema_and_the_answer_equals_transformers(served, tiny_model):
    client = served.client()
    choice = {"type": "function", "name": "get_weather"}
    made = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[TOOL], tool_choice=choice, max_output_tokens=120, temperature=0
    )
    (call,) = made.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    answer = client.responses.create(
        model="tiny",
        previous_response_id=made.id,
        tools=[TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    rendered = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21"},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    tok = tokenizer(tiny_model)
    text = tok.apply_chat_template(rendered, tools=tools, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    assert answer.usage.input_tokens == len(prompt)
    expected = tok.decode(hf_greedy(tiny_model, prompt, MAX_TOKENS), skip_special_tokens=True)
    assert answer.output_text == expected


def test_text_format_json_schema_validates_and_equals_the_chat_answer_with_response_format(served):
    client = served.client()
    made = client.responses.create(
        model="tiny",
        input="Describe the weather in Paris.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}},
        max_output_tokens=64,
        temperature=0,
    )
    jsonschema.validate(json.loads(made.output_text), WEATHER)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Describe the weather in Paris."}],
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}},
        max_completion_tokens=64,
        temperature=0,
    )
    assert made.output_text == chat.choices[0].message.content
