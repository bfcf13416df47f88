"""The model's answer, with tools: its ``<tool_call>`` blocks become OpenAI tool calls.

The format (router/api/tools.py renders the tools that ask for it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call becomes ``{"id": "call_<random>", "type": "function", "function":
{"name", "arguments"}}`` with ``arguments`` the JSON text the model wrote;
``content`` is the text outside the calls (null when there is none) and the
finish reason is ``tool_calls``. Streamed as OpenAI does: a delta with the
call's index, id, type and name (arguments ""), then its arguments text in
pieces as the model writes them. Text that is not a call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from router.api import api_responses as out
from router.metrics import FinishReason

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# A call's text up to its arguments, once the first character of the arguments is there (so that
# where the arguments start does not depend on how the text was split).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass(frozen=True)
class CallStart:
    """A call begins: its index among the answer's calls, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of call ``index``'s arguments text."""

    index: int
    text: str


Piece = str | CallStart | CallArguments


def _arguments(text: str) -> str:
    """The arguments in the text after ``"arguments":``: all but the call's own closing brace."""
    text = text.rstrip()
    return text[:-1] if text.endswith("}") else text


class ToolCallParser:
    """Text in, pieces out, in order: content text, and each call as a ``CallStart`` then
    ``CallArguments`` as its text arrives.

    Text that could be the start of ``<tool_call>`` is held back until it is
    known not to be. A call whose text begins ``{"name": "...", "arguments":``
    streams its arguments as they come (all but a closing brace that may be
    the call's own and trailing blanks are sent at once); any other text
    between the tags is parsed as a whole at ``</tool_call>``: a JSON object
    with a name and object arguments is a call, anything else is content,
    tags included. The same text gives the same pieces however it is split.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._head: re.Match[str] | None = None  # the current call's head, once seen
        self._sent = 0  # characters of the current call's arguments sent
        self.calls = 0

    def push(self, text: str) -> Iterator[Piece]:
        self._buf += text
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                # (not yet closed: hold back what may be the start of the closing tag)
                body = self._buf[: len(self._buf) - _partial_suffix(self._buf, CLOSE)] if end < 0 else self._buf[:end]
                yield from self._call_text(body, closed=end >= 0)
                if end < 0:
                    return
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_call, self._head, self._sent = False, None, 0
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if start:
                    yield self._buf[:start]
                self._buf = self._buf[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, OPEN)
            ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            if ready:
                yield ready
            return

    def flush(self) -> Iterator[Piece]:
        """At the end: held text is content; an unfinished call with a head keeps its arguments so far."""
        if self._in_call and self._head is not None:
            yield from self._send_arguments(self._head, self._buf)
        elif self._in_call:
            yield OPEN + self._buf
        elif self._buf:
            yield self._buf
        self._buf, self._in_call, self._head, self._sent = "", False, None, 0

    def _call_text(self, body: str, closed: bool) -> Iterator[Piece]:
        if self._head is None:
            self._head = _HEAD.match(body)
            if self._head is not None:
                self.calls += 1
                yield CallStart(self.calls - 1, new_call_id(), _json_string(self._head.group(1)))
        if self._head is not None:
            yield from self._send_arguments(self._head, body)
        elif closed:
            call = _whole_call(body)
            if call is None:
                yield OPEN + body + CLOSE
            else:
                self.calls += 1
                yield CallStart(self.calls - 1, new_call_id(), call[0])
                yield CallArguments(self.calls - 1, call[1])

    def _send_arguments(self, head: re.Match[str], body: str) -> Iterator[Piece]:
        arguments = _arguments(body[head.end() :])
        if len(arguments) > self._sent:
            yield CallArguments(self.calls - 1, arguments[self._sent :])
            self._sent = len(arguments)


def _json_string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:  # a bad escape: the name as written
        return raw


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of a call written in another order, or None when it is no call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if (
        not isinstance(call, dict)
        or not isinstance(call.get("name"), str)
        or not isinstance(call.get("arguments"), dict)
    ):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


def split_calls(text: str) -> tuple[str | None, list[out.ToolCall]]:
    """The whole answer: (content outside the calls, None when there is none, the calls)."""
    parser = ToolCallParser()
    content: list[str] = []
    calls: list[dict] = []
    for piece in [*parser.push(text), *parser.flush()]:
        if isinstance(piece, CallStart):
            calls.append({"id": piece.id, "name": piece.name, "arguments": ""})
        elif isinstance(piece, CallArguments):
            calls[piece.index]["arguments"] += piece.text
        else:
            content.append(piece)
    if not calls:
        return text, []
    return ("".join(content).strip() or None), [
        out.ToolCall(id=c["id"], function=out.FunctionCall(name=c["name"], arguments=c["arguments"])) for c in calls
    ]


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- answers -------------------------------------------------------------------------------------


def chat_message(
    text: str, finish_reason: FinishReason | None, parse: bool
) -> tuple[out.AssistantMessage | out.ToolCallMessage, FinishReason | None]:
    """The whole answer's message and finish reason; calls are parsed only when ``parse``."""
    if not parse:
        return out.AssistantMessage(content=text), finish_reason
    content, calls = split_calls(text)
    if not calls:
        return out.AssistantMessage(content=text), finish_reason
    return out.ToolCallMessage(content=content, tool_calls=calls), _finish(finish_reason)


class ToolCallStream:
    """A streamed answer's text through the parser: content text and the calls' deltas, in order."""

    def __init__(self) -> None:
        self._parser = ToolCallParser()

    def feed(self, text: str, last: bool) -> list[str | out.ToolCallsDelta]:
        pieces = list(self._parser.push(text))
        if last:
            pieces += self._parser.flush()
        return [p if isinstance(p, str) else out.ToolCallsDelta(tool_calls=[_delta(p)]) for p in pieces]

    def finish_reason(self, reason: FinishReason) -> FinishReason:
        return _finish(reason) if self._parser.calls else reason


def _delta(piece: CallStart | CallArguments) -> out.ToolCallDelta:
    if isinstance(piece, CallStart):
        return out.ToolCallDelta(
            index=piece.index,
            id=piece.id,
            type="function",
            function=out.FunctionCallDelta(name=piece.name, arguments=""),
        )
    return out.ToolCallDelta(index=piece.index, function=out.FunctionCallDelta(arguments=piece.text))


def _finish(reason: FinishReason | None) -> FinishReason:
    return "length" if reason == "length" else "tool_calls"
