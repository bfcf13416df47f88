"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

from collections.abc import Callable

import orjson
from pydantic import BaseModel

from router.metrics import FinishReason

DONE = "data: [DONE]\n\n"
# Stands for a chunk's text in a template: a Unicode noncharacter, so no other field holds it.
_MARK = "\ufdd0text\ufdd0"
_MARK_JSON = orjson.dumps(_MARK).decode()
# JSON leaves U+0085, U+2028 and U+2029 raw in strings; SSE ends a line only at CR or LF, but many
# clients split a stream with str.splitlines (httpx's iter_lines among them), which also breaks there.
# Escaped, every event stays one line for any reader, and decodes to the same text.
_ONE_LINE = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line(data: str) -> str:
    """``data`` (JSON) with the line breaks that only ``str.splitlines`` sees escaped."""
    return data.translate(_ONE_LINE)


def sse_event(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One SSE event. Nulls are kept (OpenAI sends ``"finish_reason": null``);
    ``exclude`` drops top-level fields (``usage`` unless the client asked for it)."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude=exclude)
    else:
        data = orjson.dumps(payload).decode()
    return f"data: {one_line(data)}\n\n"


class ChunkTemplate:
    """The text chunks of one stream, whose other fields (id, model, created, ...) never change.

    ``make(text, finish_reason)`` builds the chunk model; it is encoded once per
    finish reason with a placeholder for the text, and each chunk then costs one
    ``orjson.dumps`` of its text: the same JSON as ``sse_event(make(text, reason))``,
    without building and validating a model per token.
    """

    def __init__(self, make: Callable[[str, FinishReason | None], BaseModel], exclude: set[str] | None = None) -> None:
        self._make = make
        self._exclude = exclude
        self._parts: dict[FinishReason | None, tuple[str, str] | None] = {}

    def event(self, text: str, finish_reason: FinishReason | None = None) -> str:
        if finish_reason not in self._parts:
            data = one_line(self._make(_MARK, finish_reason).model_dump_json(exclude=self._exclude))
            if data.count(_MARK_JSON) == 1:
                before, _, after = data.partition(_MARK_JSON)
                self._parts[finish_reason] = (f"data: {before}", f"{after}\n\n")
            else:  # another field holds the placeholder too (a client's request id could): no template
                self._parts[finish_reason] = None
        parts = self._parts[finish_reason]
        if parts is None:
            return sse_event(self._make(text, finish_reason), self._exclude)
        return parts[0] + one_line(orjson.dumps(text).decode()) + parts[1]
