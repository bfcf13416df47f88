"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One SSE event. Nulls are kept (OpenAI sends ``"finish_reason": null``);
    ``exclude`` drops top-level fields (``usage`` unless the client asked for it)."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude=exclude)
    else:
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"
