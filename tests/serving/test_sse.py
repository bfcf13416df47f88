import json

from router import api_responses as out
from router.sse import DONE, sse_event


def test_sse_event_is_one_data_line_and_a_blank_line():
    ev = sse_event({"a": "é"})
    assert ev == 'data: {"a":"é"}\n\n'
    assert DONE == "data: [DONE]\n\n"


def test_chunk_keeps_null_finish_reason_and_can_drop_usage():
    chunk = out.ChatCompletionChunk(id="x", created=1, model="m",
                                    choices=[out.ChatChunkChoice(delta=out.Delta(content="hi"))])
    body = json.loads(sse_event(chunk, exclude={"usage"})[len("data: "):])
    assert body["choices"][0]["finish_reason"] is None
    assert body["choices"][0]["delta"] == {"role": None, "content": "hi"}
    assert "usage" not in body
    assert json.loads(sse_event(chunk)[6:])["usage"] is None
