"""Tools (function calling), in the Hermes/Qwen style the project's chat templates use.

The tools are rendered by the model's chat template (``tools=`` of
``apply_chat_template``); the model answers each call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``:

- ``auto`` (the default with tools): the answer is parsed for such calls;
- ``none``: no tools are rendered and nothing is parsed;
- ``required`` or ``{"type": "function", "function": {"name": ...}}``: a grammar
  (Lark with the call's JSON schema inside) forces exactly one call, of any
  tool or of the named one, whose arguments match that tool's parameters.

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
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from engine.structured import JSON_OPTIONS
from router import api_responses as out
from router.errors import OpenAIError
from server_common.worker_requests import StructuredSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    function: FunctionDef | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text


class EarlierCall(BaseModel):
    """A call in an assistant message of the conversation."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: str = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its grammar and its answer."""

    tools: list[dict] | None = None  # for the chat template; None renders none
    parse: bool = False  # look for calls in the answer
    constraints: list[tuple[str, StructuredSpec]] = field(default_factory=list)  # a forced call's grammar


def template_uses_tools(tokenizer) -> bool:
    """Whether the chat template renders ``tools`` at all (SmolLM2's does not)."""
    messages = [{"role": "user", "content": "x"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False)
        with_tools = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False)
    except Exception:  # noqa: BLE001 (a template that fails on tools does not support them)
        return False
    return plain != with_tools


def plan_tools(tools: list[Any] | None, tool_choice: Any, template_has_tools: bool) -> ToolPlan:
    """Check ``tools`` and ``tool_choice``; 400 naming the field for anything invalid."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
        return ToolPlan()
    functions = _functions(tools)
    choice, name = _choice(tool_choice, functions)
    if choice == "none":
        return ToolPlan()
    if not template_has_tools:
        raise OpenAIError(400, "this model's chat template does not support tools", param="tools")
    rendered = [{"type": "function", "function": {k: v for k, v in f.model_dump().items()
                                                  if k != "strict" and v is not None}} for f in functions.values()]
    if choice == "auto":
        return ToolPlan(rendered, parse=True)
    forced = list(functions.values()) if choice == "required" else [functions[name]]
    spec = StructuredSpec(kind="lark", value=call_grammar(forced))
    return ToolPlan(rendered, parse=True, constraints=[("tool_choice", spec)])


def call_grammar(functions: list[FunctionDef]) -> str:
    """A Lark grammar for one call of one of ``functions``, its arguments matching its parameters."""
    options = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": _parameters(f)},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"anyOf": options, "x-guidance": JSON_OPTIONS}
    return f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}'


def template_message(m) -> dict:
    """A chat message for the template; a call's arguments become an object, as templates expect."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            arguments = call.function.arguments
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    pass  # left as text: the template shows what the client sent
            calls.append({**call.model_dump(exclude_none=True),
                          "function": {"name": call.function.name, "arguments": arguments}})
        message["tool_calls"] = calls
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        message["name"] = m.name
    return message


# ---- parsing the answer ------------------------------------------------------------------------

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
        self._head: re.Match | None = None  # the current call's head, once seen
        self._sent = 0  # characters of the current call's arguments sent
        self.calls = 0

    def push(self, text: str) -> Iterator[Piece]:
        self._buf += text
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                # (not yet closed: hold back what may be the start of the closing tag)
                body = self._buf[:len(self._buf) - _partial_suffix(self._buf, CLOSE)] if end < 0 else self._buf[:end]
                yield from self._call_text(body, closed=end >= 0)
                if end < 0:
                    return
                self._buf = self._buf[end + len(CLOSE):]
                self._in_call, self._head, self._sent = False, None, 0
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if start:
                    yield self._buf[:start]
                self._buf = self._buf[start + len(OPEN):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, OPEN)
            ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            if ready:
                yield ready
            return

    def flush(self) -> Iterator[Piece]:
        """At the end: held text is content; an unfinished call with a head keeps its arguments so far."""
        if self._in_call and self._head is not None:
            yield from self._send_arguments(self._buf)
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
            yield from self._send_arguments(body)
        elif closed:
            call = _whole_call(body)
            if call is None:
                yield OPEN + body + CLOSE
            else:
                self.calls += 1
                yield CallStart(self.calls - 1, new_call_id(), call[0])
                yield CallArguments(self.calls - 1, call[1])

    def _send_arguments(self, body: str) -> Iterator[Piece]:
        arguments = _arguments(body[self._head.end():])
        if len(arguments) > self._sent:
            yield CallArguments(self.calls - 1, arguments[self._sent:])
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
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"),
                                                                                           dict):
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
        out.ToolCall(id=c["id"], function=out.FunctionCall(name=c["name"], arguments=c["arguments"])) for c in calls]


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- checking the request ------------------------------------------------------------------------

def _functions(tools: list[Any]) -> dict[str, FunctionDef]:
    functions: dict[str, FunctionDef] = {}
    for i, raw in enumerate(tools):
        param = f"tools[{i}]"
        try:
            tool = ToolDef.model_validate(raw)
        except ValidationError as exc:
            raise OpenAIError(400, f"{param}: {exc.errors()[0]['msg']}", param=param) from None
        if tool.type != "function":
            raise OpenAIError(400, f"{param}: only tools of type 'function' are supported, got {tool.type!r}",
                              param=f"{param}.type")
        f = tool.function
        if f is None or not f.name:
            raise OpenAIError(400, f"{param}: a function tool needs function.name", param=f"{param}.function.name")
        if not NAME.fullmatch(f.name):
            raise OpenAIError(400, f"{param}: function name {f.name!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                              param=f"{param}.function.name")
        if f.name in functions:
            raise OpenAIError(400, f"{param}: the function name {f.name!r} is given twice",
                              param=f"{param}.function.name")
        if f.parameters is not None and f.parameters.get("type") != "object":
            raise OpenAIError(400, f"{param}: function.parameters must be a JSON schema of type 'object'",
                              param=f"{param}.function.parameters")
        functions[f.name] = f
    return functions


def _choice(tool_choice: Any, functions: dict[str, FunctionDef]) -> tuple[str, str | None]:
    """('auto' | 'none' | 'required', None) or ('function', the name of the function to call)."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("auto", "none", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if not isinstance(name, str):
            raise OpenAIError(400, "tool_choice.function.name is required", param="tool_choice")
        if name not in functions:
            raise OpenAIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                              param="tool_choice")
        return "function", name
    raise OpenAIError(400, "tool_choice must be 'auto', 'none', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def _parameters(f: FunctionDef) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


# ---- answers -------------------------------------------------------------------------------------

def chat_message(text: str, finish_reason: str, plan: ToolPlan) -> tuple[out.AssistantMessage | out.ToolCallMessage,
                                                                           str]:
    """The whole answer's message and finish reason: calls parsed when the request had tools."""
    if not plan.parse:
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

    def finish_reason(self, reason: str) -> str:
        return _finish(reason) if self._parser.calls else reason


def _delta(piece: CallStart | CallArguments) -> out.ToolCallDelta:
    if isinstance(piece, CallStart):
        return out.ToolCallDelta(index=piece.index, id=piece.id, type="function",
                                 function=out.FunctionCallDelta(name=piece.name, arguments=""))
    return out.ToolCallDelta(index=piece.index, function=out.FunctionCallDelta(arguments=piece.text))


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "tool_calls"
