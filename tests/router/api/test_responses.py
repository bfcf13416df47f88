"""/v1/responses through the official openai SDK against the router, its workers scripted (no servers):
the request as the chat path runs it, the response and its stream, storage, chaining, owners."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from router.api.model import ServedModel
from router.app import create_app
from router.settings import ResponseStoreSettings, RouterSettings
from tests.support.fakes import FakeWorkerClient, in_rotation
from tests.support.router_client import WORKERS

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tiny_model) -> ServedModel:
    """The tiny model's tokenizer and chat template (which renders tools)."""
    return ServedModel.load("tiny", tiny_model)


def ids(model: ServedModel, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def router(model: ServedModel, fake: FakeWorkerClient, **overrides) -> TestClient:
    settings = RouterSettings(
        model_path=model.root, served_model_name="tiny", workers=WORKERS, queue_timeout_s=0.1, **overrides
    )
    return TestClient(in_rotation(create_app(settings, model=model, client=fake)), raise_server_exceptions=False)


def sdk(client: TestClient, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)


def test_a_response_is_the_chat_answer_stored_and_readable_until_deleted(served):
    fake = FakeWorkerClient(reply=ids(served, "Paris."))
    with router(served, fake) as c:
        r = sdk(c).responses.create(model="tiny", input="Capital of France?", instructions="Be brief.", temperature=0)
        assert r.object == "response" and r.status == "completed" and r.output_text == "Paris."
        ((_, sent),) = fake.opened
        prompt = served.encode_chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
        )
        assert sent.prompt_token_ids == prompt and sent.sampling.temperature == 0
        assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), len(ids(served, "Paris.")))
        (message,) = r.output
        assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"

        again = sdk(c).responses.retrieve(r.id)
        assert again.model_dump() == r.model_dump()
        items = sdk(c).responses.input_items.list(r.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Capital of France?")]

        deleted = c.delete(f"/v1/responses/{r.id}")
        assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            sdk(c).responses.retrieve(r.id)
        assert c.delete(f"/v1/responses/{r.id}").status_code == 404


def test_the_streamed_events_reassemble_to_the_stored_response(served):
    fake = FakeWorkerClient(reply=ids(served, "Paris is the capital."))
    with router(served, fake) as c:
        events = list(sdk(c).responses.create(model="tiny", input="Capital of France?", stream=True))
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == "Paris is the capital."
        final = events[-1].response
        assert final.output_text == deltas and final.status == "completed"
        assert sdk(c).responses.retrieve(final.id).model_dump() == final.model_dump()
        done = next(e for e in events if e.type == "response.output_item.done")
        assert done.item.model_dump() == final.output[0].model_dump()


def test_previous_response_id_continues_the_conversation_on_the_same_decode_server(served):
    fake = FakeWorkerClient(reply=ids(served, "Paris."))
    with router(served, fake) as c:
        first = sdk(c).responses.create(model="tiny", input="Capital of France?", instructions="Be brief.")
        second = sdk(c).responses.create(model="tiny", input="And of Italy?", previous_response_id=first.id)
        third = sdk(c).responses.create(model="tiny", input="And of Spain?", previous_response_id=second.id)
    conversation = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Spain?"},
    ]
    # Instructions belong to their own response (as OpenAI): the later turns do not carry them.
    assert fake.opened[1][1].prompt_token_ids == served.encode_chat(conversation[:3])
    assert fake.opened[2][1].prompt_token_ids == served.encode_chat(conversation)
    # Round robin would send turn 2 to d1: the conversation's server, which caches its KV, goes first.
    assert [name for name, _ in fake.opened] == ["d0", "d0", "d0"]
    assert third.previous_response_id == second.id


def test_another_api_key_cannot_read_continue_or_delete_a_response(served):
    fake = FakeWorkerClient(reply=ids(served, "ok"))
    with router(served, fake, api_keys=("key-a", "key-b")) as c:
        r = sdk(c, "key-a").responses.create(model="tiny", input="hi")
        with pytest.raises(openai.NotFoundError):
            sdk(c, "key-b").responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            sdk(c, "key-b").responses.create(model="tiny", input="more", previous_response_id=r.id)
        assert c.delete(f"/v1/responses/{r.id}", headers={"authorization": "Bearer key-b"}).status_code == 404
        assert sdk(c, "key-a").responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.AuthenticationError):
            sdk(c, "key-c").responses.retrieve(r.id)


def test_store_false_keeps_nothing(served):
    fake = FakeWorkerClient(reply=ids(served, "ok"))
    with router(served, fake) as c:
        r = sdk(c).responses.create(model="tiny", input="hi", store=False)
        assert r.output_text == "ok"
        with pytest.raises(openai.NotFoundError):
            sdk(c).responses.retrieve(r.id)


def test_stored_responses_outlive_the_router_in_a_sqlite_file(served, tmp_path):
    store = ResponseStoreSettings(path=str(tmp_path / "responses.sqlite"))
    fake = FakeWorkerClient(reply=ids(served, "Paris."))
    with router(served, fake, response_store=store) as c:
        first = sdk(c).responses.create(model="tiny", input="Capital of France?")
    with router(served, fake, response_store=store) as c:  # a new router process's app, the same file
        assert sdk(c).responses.retrieve(first.id).output_text == "Paris."
        sdk(c).responses.create(model="tiny", input="And of Italy?", previous_response_id=first.id)
    assert fake.opened[-1][1].prompt_token_ids == served.encode_chat(
        [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ]
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_function_call_round_trip(served, stream):
    fake = FakeWorkerClient(reply=ids(served, CALL_TEXT))
    with router(served, fake) as c:
        made = sdk(c).responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL], stream=stream)
        if stream:
            events = list(made)
            args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            assert json.loads(args) == {"city": "Paris"}
            assert not any(e.type == "response.output_text.delta" for e in events)
            made = events[-1].response
        (call,) = made.output
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
        fake.reply = ids(served, "It is sunny in Paris.")
        answer = sdk(c).responses.create(
            model="tiny",
            previous_response_id=made.id,
            tools=[TOOL],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"}],
        )
        assert answer.output_text == "It is sunny in Paris."
    sent = fake.opened[-1][1].prompt_token_ids
    assert sent == served.encode_chat(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
    )


def test_text_format_json_schema_constrains_the_answer_as_chat_does(served):
    fake = FakeWorkerClient(reply=ids(served, '{"city": "Paris"}'))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    with router(served, fake) as c:
        r = sdk(c).responses.create(
            model="tiny",
            input="Where?",
            text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        )
    assert json.loads(r.output_text) == {"city": "Paris"}
    spec = fake.opened[0][1].sampling.structured
    assert spec.kind == "json_schema" and json.loads(spec.value) == schema
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"background": True, "store": False}, "background"),  # background needs store
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_fields_that_would_change_the_answer_and_are_not_supported_are_a_400_naming_them(served, extra, param):
    fake = FakeWorkerClient(reply=ids(served, "ok"))
    with router(served, fake) as c:
        r = c.post("/v1/responses", json={"model": "tiny", "input": "hi", **extra})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert fake.opened == []


def test_tokenize_and_detokenize_use_the_served_tokenizer(served):
    fake = FakeWorkerClient(reply=[1])
    with router(served, fake) as c:
        prompt = c.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
        assert prompt["tokens"] == served.encode_prompt("Hello world") and prompt["count"] == len(prompt["tokens"])
        assert prompt["max_model_len"] == served.max_model_len
        messages = [{"role": "user", "content": "hi"}]
        chat = c.post("/tokenize", json={"messages": messages}).json()
        assert chat["tokens"] == served.encode_chat(messages)
        text = c.post("/detokenize", json={"tokens": prompt["tokens"]}).json()
        assert text == {"prompt": served.tokenizer.decode(prompt["tokens"])}
        assert c.post("/tokenize", json={"prompt": "x", "messages": messages}).status_code == 400
        bad = c.post("/detokenize", json={"tokens": [served.vocab_size]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metadata_is_bounded_as_openai_bounds_it_and_comes_back_with_the_response(served):
    fake = FakeWorkerClient(reply=ids(served, "ok"))
    with router(served, fake) as c:
        r = sdk(c).responses.create(model="tiny", input="hi", metadata={"session": "s-1"})
        assert r.metadata == {"session": "s-1"} and sdk(c).responses.retrieve(r.id).metadata == {"session": "s-1"}
        for metadata, param in (
            ({"k" * 65: "v"}, "metadata"),
            ({"k": "v" * 513}, "metadata.k"),
            ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ):
            bad = c.post("/v1/responses", json={"model": "tiny", "input": "hi", "metadata": metadata})
            assert bad.status_code == 400 and bad.json()["error"]["param"].startswith(param), bad.text


def test_limits_of_the_chat_path_are_reported_with_this_apis_field_names(served):
    fake = FakeWorkerClient(reply=ids(served, "ok"))
    with router(served, fake, max_tokens=16) as c:
        doc = c.get("/openapi.json").json()
        props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
        assert props["max_output_tokens"]["anyOf"][0]["maximum"] == 16  # the published bound, as on chat
        r = c.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 17})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_output_tokens"
    assert "max_output_tokens" in error["message"] and "max_completion_tokens" not in error["message"]
