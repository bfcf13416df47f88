"""router/api/responses.py ``OutputEvents``: a streamed response's events, numbered from 0 in the
order they are sent, and its output items (a message or a function call each) opened, filled and
closed one after another, the done events carrying the whole text or arguments."""

from __future__ import annotations

import json

from router.api.api_responses import FunctionCallDelta, ToolCallDelta
from router.api.responses import OutputEvents


def parsed(sse: list[str]) -> list[dict]:
    """Each server-sent event's data, its ``event:`` line checked against the data's type."""
    out = []
    for raw in sse:
        assert raw.endswith("\n\n")
        event_line, data_line = raw[:-2].split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        out.append(data)
    return out


def opening_call(call_id: str, name: str, arguments: str = "") -> ToolCallDelta:
    return ToolCallDelta(
        index=0, id=call_id, type="function", function=FunctionCallDelta(name=name, arguments=arguments)
    )


def more_arguments(arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index=0, function=FunctionCallDelta(arguments=arguments))


def message(text: str, status: str, index: int = 0) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"id": f"msg_r1_{index}", "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(call_id: str, name: str, arguments: str, status: str, index: int) -> dict:
    return {
        "id": f"fc_r1_{index}",
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def test_text_fills_one_message_and_its_done_events_carry_the_whole_text():
    events = OutputEvents("r1")
    sent = parsed(events.text("Hel") + events.text("lo") + events.close_item())
    where = {"item_id": "msg_r1_0", "output_index": 0, "content_index": 0}
    empty_part = {"type": "output_text", "text": "", "annotations": []}
    assert sent == [
        {
            "type": "response.output_item.added",
            "sequence_number": 0,
            "output_index": 0,
            "item": message("", "in_progress"),
        },
        {"type": "response.content_part.added", "sequence_number": 1, **where, "part": empty_part},
        {"type": "response.output_text.delta", "sequence_number": 2, **where, "delta": "Hel", "logprobs": []},
        {"type": "response.output_text.delta", "sequence_number": 3, **where, "delta": "lo", "logprobs": []},
        {"type": "response.output_text.done", "sequence_number": 4, **where, "text": "Hello", "logprobs": []},
        {"type": "response.content_part.done", "sequence_number": 5, **where, "part": {**empty_part, "text": "Hello"}},
        {
            "type": "response.output_item.done",
            "sequence_number": 6,
            "output_index": 0,
            "item": message("Hello", "completed"),
        },
    ]
    assert events.index == 0


def test_a_function_call_opens_an_item_gathers_its_arguments_and_closes_with_all_of_them():
    events = OutputEvents("r1")
    sent = parsed(
        events.call(opening_call("call_1", "get_weather"))
        + events.call(more_arguments('{"city": '))
        + events.call(more_arguments('"Paris"}'))
        + events.close_item()
    )
    arguments = '{"city": "Paris"}'
    assert sent == [
        {
            "type": "response.output_item.added",
            "sequence_number": 0,
            "output_index": 0,
            "item": call_item("call_1", "get_weather", "", "in_progress", 0),
        },
        {
            "type": "response.function_call_arguments.delta",
            "sequence_number": 1,
            "item_id": "fc_r1_0",
            "output_index": 0,
            "delta": '{"city": ',
        },
        {
            "type": "response.function_call_arguments.delta",
            "sequence_number": 2,
            "item_id": "fc_r1_0",
            "output_index": 0,
            "delta": '"Paris"}',
        },
        {
            "type": "response.function_call_arguments.done",
            "sequence_number": 3,
            "item_id": "fc_r1_0",
            "output_index": 0,
            "name": "get_weather",
            "arguments": arguments,
        },
        {
            "type": "response.output_item.done",
            "sequence_number": 4,
            "output_index": 0,
            "item": call_item("call_1", "get_weather", arguments, "completed", 0),
        },
    ]


def test_arguments_in_the_opening_delta_are_sent_at_once():
    events = OutputEvents("r1")
    sent = parsed(events.call(opening_call("call_1", "f", "{}")))
    assert [(e["type"], e.get("delta")) for e in sent] == [
        ("response.output_item.added", None),
        ("response.function_call_arguments.delta", "{}"),
    ]


def test_text_a_call_and_text_again_are_three_items_each_closed_before_the_next_opens():
    events = OutputEvents("r1")
    sent = parsed(
        events.text("Let me look.")
        + events.call(opening_call("call_1", "get_weather", "{}"))
        + events.text("Done.")
        + events.close_item()
    )
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    items = [(e["type"], e["output_index"], e["item"]["id"]) for e in sent if "item" in e]
    assert items == [
        ("response.output_item.added", 0, "msg_r1_0"),
        ("response.output_item.done", 0, "msg_r1_0"),
        ("response.output_item.added", 1, "fc_r1_1"),
        ("response.output_item.done", 1, "fc_r1_1"),
        ("response.output_item.added", 2, "msg_r1_2"),
        ("response.output_item.done", 2, "msg_r1_2"),
    ]
    done_texts = [e["text"] for e in sent if e["type"] == "response.output_text.done"]
    assert done_texts == ["Let me look.", "Done."]  # the second message does not carry the first's text
    assert events.index == 2


def test_a_second_call_closes_the_first():
    events = OutputEvents("r1")
    sent = parsed(
        events.call(opening_call("call_1", "a", '{"x": 1}'))
        + events.call(opening_call("call_2", "b", '{"y": 2}'))
        + events.close_item()
    )
    closed = [e["item"] for e in sent if e["type"] == "response.output_item.done"]
    assert closed == [
        call_item("call_1", "a", '{"x": 1}', "completed", 0),
        call_item("call_2", "b", '{"y": 2}', "completed", 1),
    ]


def test_closing_with_nothing_open_sends_nothing_and_numbering_goes_on_across_calls():
    events = OutputEvents("r1")
    assert events.close_item() == []
    created = parsed([events.event("response.created", response={"id": "resp_1"})])
    assert created == [{"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1"}}]
    texts = parsed(events.text("hi") + events.close_item())
    assert events.close_item() == []  # closed once only
    completed = parsed([events.event("response.completed")])
    assert [e["sequence_number"] for e in texts] == [1, 2, 3, 4, 5, 6]
    assert completed[0]["sequence_number"] == 7


def test_an_empty_answer_is_an_empty_completed_message():
    events = OutputEvents("r1")
    sent = parsed(events.text("") + events.close_item())
    assert sent[-1]["item"] == message("", "completed")
    assert [e["type"] for e in sent] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
