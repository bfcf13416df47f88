"""Structured-output fields of the OpenAI API (and vLLM's), mapped to one ``StructuredSpec``.

Accepted, on chat and completions alike:

- ``response_format``: ``{"type": "text" | "json_object" | "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}`` (OpenAI);
- ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``
  (vLLM's current name; its other options are ignored);
- ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM's older names).

At most one constraint per request (tool calls forced by ``tool_choice``
count as one: router/api/tools.py), within the router's ``GrammarLimits``
(checked here, before anything is compiled); the router then compiles it
once in its sandbox (router/api/grammar_check.py) to refuse a bad one with a
400 naming the parameter, and the servers compile it again. A ``grammar``
is Lark or GBNF (converted to Lark here, after its size is checked). JSON is
generated compact (engine/structured.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from llguidance.gbnf_to_lark import any_to_lark
from pydantic import BaseModel, ConfigDict, Field

from engine.request import StructuredSpec
from engine.structured import GrammarLimits, check_bounds
from router.errors import OpenAIError

ANY_OBJECT = '{"type": "object"}'


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # every schema is enforced strictly


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The request fields that constrain the output to a grammar."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_constraints(self, limits: GrammarLimits = GrammarLimits()) -> list[tuple[str, StructuredSpec]]:
        """(the parameter, its spec) for every constraint the request names, unchecked but for a grammar's
        size (checked before it is converted to Lark)."""
        found: list[tuple[str, StructuredSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredSpec(kind="json_schema", value=ANY_OBJECT)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise OpenAIError(
                    400,
                    "response_format of type json_schema needs a json_schema object",
                    param="response_format.json_schema",
                )
            schema = {} if rf.json_schema.schema_ is None else rf.json_schema.schema_
            found.append(("response_format", _json_spec(schema)))
        so = self.structured_outputs
        if so is not None:
            named = [
                (key, value)
                for key, value in (
                    ("json", so.json_),
                    ("regex", so.regex),
                    ("choice", so.choice),
                    ("grammar", so.grammar),
                )
                if value is not None
            ]
            if so.json_object:
                named.append(("json_object", ANY_OBJECT))
            for key, value in named:
                found.append((f"structured_outputs.{key}", _spec(key, value, f"structured_outputs.{key}", limits)))
        for key in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{key}")
            if value is not None:
                found.append((f"guided_{key}", _spec(key, value, f"guided_{key}", limits)))
        return found


def one_constraint(
    constraints: list[tuple[str, StructuredSpec]], limits: GrammarLimits = GrammarLimits()
) -> tuple[str, StructuredSpec] | None:
    """The one constraint (its parameter and spec) within ``limits``, not yet compiled; 400 for two, or
    for one over a limit."""
    if not constraints:
        return None
    if len(constraints) > 1:
        names = ", ".join(param for param, _ in constraints)
        raise OpenAIError(
            400, f"only one structured output constraint per request, got {names}", param=constraints[1][0]
        )
    param, spec = constraints[0]
    try:
        check_bounds(spec, limits)
    except ValueError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=param) from None
    return param, spec


def _json_spec(schema: Any, param: str = "response_format") -> StructuredSpec:
    try:
        return StructuredSpec(kind="json_schema", value=json.dumps(schema))
    except RecursionError:
        raise OpenAIError(400, f"{param}: the JSON schema is nested too deeply", param=param) from None


def _spec(key: str, value: Any, param: str, limits: GrammarLimits) -> StructuredSpec:
    if isinstance(value, str) and len(value) > limits.max_bytes:
        raise OpenAIError(
            400, f"{param}: it has {len(value)} characters; at most {limits.max_bytes} bytes are accepted", param=param
        )
    if key in ("json", "json_object"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise OpenAIError(400, f"{param}: the JSON schema is not valid JSON: {exc}", param=param) from None
            except RecursionError:
                raise OpenAIError(400, f"{param}: the JSON schema is nested too deeply", param=param) from None
        return _json_spec(value, param)
    if key == "regex":
        return StructuredSpec(kind="regex", value=value)
    if key == "choice":
        return StructuredSpec(kind="choice", value=json.dumps(value))
    try:
        return StructuredSpec(kind="lark", value=any_to_lark(value))
    except Exception as exc:  # noqa: BLE001 (GbnfToLarkError, or a bare Exception: "No 'root' rule found")
        raise OpenAIError(400, f"{param}: the grammar is neither Lark nor GBNF: {exc}", param=param) from None
