import json

from router.api import api_responses as out
from router.api.sse import DONE, ChunkTemplate, sse_event


def test_sse_event_is_one_data_line_and_a_blank_line():
    ev = sse_event({"a": "é"})
    assert ev == 'data: {"a":"é"}\n\n'
    assert DONE == "data: [DONE]\n\n"


def test_chunk_keeps_null_finish_reason_and_can_drop_usage():
    chunk = out.ChatCompletionChunk(
        id="x", created=1, model="m", choices=[out.ChatChunkChoice(delta=out.Delta(content="hi"))]
    )
    body = json.loads(sse_event(chunk, exclude={"usage"})[len("data: ") :])
    assert body["choices"][0]["finish_reason"] is None
    assert body["choices"][0]["delta"] == {"role": None, "content": "hi"}
    assert "usage" not in body
    assert json.loads(sse_event(chunk)[6:])["usage"] is None


def test_a_chunk_template_writes_what_the_model_would_for_any_text():
    def make(text, reason):
        return out.Completion(
            id="cmpl-1", created=7, model="m", choices=[out.CompletionChoice(text=text, finish_reason=reason)]
        )

    for exclude in ({"usage"}, None):
        template = ChunkTemplate(make, exclude)
        for text, reason in [('héllo "quoted"\n', None), ("", "stop"), ("\u2028\x00\ufdd0x", "length")]:
            event = template.event(text, reason)
            assert event.startswith("data: ") and event.endswith("\n\n")
            assert json.loads(event[6:]) == json.loads(sse_event(make(text, reason), exclude)[6:])


def test_every_event_stays_one_line_for_readers_that_split_with_splitlines():
    """httpx's ``iter_lines`` splits at U+0085, U+2028 and U+2029 too; a token's text may hold them."""

    def make(text, reason):
        return out.Completion(
            id="c", created=1, model="m", choices=[out.CompletionChoice(text=text, finish_reason=reason)]
        )

    text = "a\x85b\u2028c\u2029d"
    for event in (sse_event(make(text, None)), sse_event({"t": text}), ChunkTemplate(make).event(text)):
        assert event.splitlines() == [event.removesuffix("\n\n"), ""]
        assert text in json.dumps(json.loads(event[6:]), ensure_ascii=False)
