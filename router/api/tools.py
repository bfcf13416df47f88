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

The answer's calls are parsed in router/api/tool_calls.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from engine.request import StructuredSpec
from engine.structured import JSON_OPTIONS
from router.api.tool_calls import CLOSE, OPEN
from router.errors import OpenAIError

if TYPE_CHECKING:
    from router.api.api_requests import ChatMessage  # which imports this module

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    function: FunctionDef | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text


class EarlierCall(BaseModel):
    """A call in an assistant message of the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: str = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its grammar and its answer."""

    tools: list[dict] | None = None  # for the chat template; None renders none
    parse: bool = False  # look for calls in the answer
    constraints: list[tuple[str, StructuredSpec]] = field(default_factory=list)  # a forced call's grammar


def template_uses_tools(tokenizer: Any) -> bool:
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
    rendered = [
        {"type": "function", "function": {k: v for k, v in f.model_dump().items() if k != "strict" and v is not None}}
        for f in functions.values()
    ]
    if choice == "auto":
        return ToolPlan(rendered, parse=True)
    forced = list(functions.values()) if name is None else [functions[name]]  # none named ("required"): any
    spec = StructuredSpec(kind="lark", value=call_grammar(forced))
    return ToolPlan(rendered, parse=True, constraints=[("tool_choice", spec)])


def call_grammar(functions: list[FunctionDef]) -> str:
    """A Lark grammar for one call of one of ``functions``, its arguments matching its parameters."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": _parameters(f)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {"anyOf": options, "x-guidance": JSON_OPTIONS}
    return f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}'


def template_message(m: ChatMessage) -> dict:
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
            calls.append(
                {**call.model_dump(exclude_none=True), "function": {"name": call.function.name, "arguments": arguments}}
            )
        message["tool_calls"] = calls
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        message["name"] = m.name
    return message


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
            raise OpenAIError(
                400, f"{param}: only tools of type 'function' are supported, got {tool.type!r}", param=f"{param}.type"
            )
        f = tool.function
        if f is None or not f.name:
            raise OpenAIError(400, f"{param}: a function tool needs function.name", param=f"{param}.function.name")
        if not NAME.fullmatch(f.name):
            raise OpenAIError(
                400,
                f"{param}: function name {f.name!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                param=f"{param}.function.name",
            )
        if f.name in functions:
            raise OpenAIError(
                400, f"{param}: the function name {f.name!r} is given twice", param=f"{param}.function.name"
            )
        if f.parameters is not None and f.parameters.get("type") != "object":
            raise OpenAIError(
                400,
                f"{param}: function.parameters must be a JSON schema of type 'object'",
                param=f"{param}.function.parameters",
            )
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
            raise OpenAIError(
                400, f"tool_choice names the function {name!r}, which is not among the tools", param="tool_choice"
            )
        return "function", name
    raise OpenAIError(
        400,
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def _parameters(f: FunctionDef) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
