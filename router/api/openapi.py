"""The router's published OpenAPI document (``GET /openapi.json``): what each route really answers.

FastAPI documents a 422 ``HTTPValidationError`` for every route with a body or
parameters; the router never sends one (router/errors.py turns every
validation error into a 400 in OpenAI's shape), so the document drops it and
names, per route, the statuses the route can return, each with the one
``ErrorResponse`` body, and the ``X-Request-Id`` header that every answer
carries (``Retry-After`` too on a 429 or 503 from a generation route).

The document is this deployment's: the bounds that depend on the model and
the configuration (token ids below the vocabulary size, ``max_tokens`` at most
``router.max_tokens`` or the context, whether an API key is needed) are
written into it when the app builds it, so a client, or a fuzzer, reading it
knows what this router accepts. What a JSON schema cannot say is left to a 400
naming the field: the prompt's length in tokens after templating, and
``min_tokens`` above the request's ``max_tokens``.

Admin and debug routes (``/admin/...``, ``/debug/...``) are left out: they are
the operators' tools, authorized by the cluster's internal secret rather than
the clients' API keys, documented in router/admin.py and the README, and a
document that a client SDK generator or a fuzzer holding an API key reads
should not invite them to drain or remove workers.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

TOKEN_ID = "x-pdserve-token-id"  # marks a schema node holding a token id (an integer, or its decimal string)
MAX_NEW_TOKENS = "x-pdserve-max-new-tokens"  # marks max_tokens, max_completion_tokens and min_tokens


class ErrorDetail(BaseModel):
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the router answers, as OpenAI's API does (router/errors.py)."""

    error: ErrorDetail


class WorkerHealth(BaseModel):
    name: str
    role: Literal["prefill", "decode"]
    url: str
    healthy: bool
    in_rotation: bool


HealthStatus = Literal["ok", "degraded", "draining"]


class Health(BaseModel):
    """GET /health: 200 while a decode server is in rotation and the router is not draining, else 503."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)
    status: HealthStatus
    workers: list[WorkerHealth]
    launch_id: str | None


REASONS = {
    400: "Bad input, naming the field in `param`.",
    401: "Missing or wrong API key.",
    404: "No such model (`code: model_not_found`), or no such stored response (`code: not_found`).",
    413: "The body is larger than `router.max_body_bytes`.",
    429: "Every decode server is at its limit and the waiting room is full or the wait too long "
    "(`Retry-After` says when to try again).",
    500: "The request failed inside the cluster; the message names the request id.",
    503: "No decode server is in rotation, or the router is shutting down (`Retry-After`).",
}
REQUEST_ID = {
    "X-Request-Id": {
        "description": "This request's id, in the logs and traces too.",
        "required": True,
        "schema": {"type": "string", "pattern": "^req-"},
    }
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` for these error statuses, each in OpenAI's error shape."""
    return {
        status: {
            "model": ErrorResponse,
            "description": REASONS[status],
            "headers": REQUEST_ID | (RETRY_AFTER if status in (429, 503) else {}),
        }
        for status in statuses
    }


def answered(description: str, events: str | None = None) -> dict[int | str, dict[str, Any]]:
    """A route's 200, its body described in words (the Responses API's shapes are OpenAI's own);
    ``events``: with ``stream: true`` it answers server-sent events, each described so."""
    answer: dict[str, Any] = {"description": description, "headers": REQUEST_ID}
    if events is not None:
        answer["content"] = {"application/json": {"schema": {"type": "object"}}, "text/event-stream": _events(events)}
    return {200: answer}


def _events(description: str) -> dict[str, Any]:
    return {
        "schema": {  # in OpenAPI 3.1, the schema of one event
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {"type": "string", "contentMediaType": "application/json", "description": description}
            },
        }
    }


def generation_responses(body: type[BaseModel], chunk: str) -> dict[int | str, dict[str, Any]]:
    """A generation route's answers: ``body`` as JSON, or with ``stream: true`` server-sent events of ``chunk``."""
    stream = _events(f"a {chunk} as JSON; an ErrorResponse if the request fails mid-stream; `[DONE]` last")
    return {
        200: {
            "model": body,
            "description": f"The {body.__name__}; with `stream: true`, a stream of {chunk}s.",
            "content": {"text/event-stream": stream},
            "headers": REQUEST_ID,
        },
        **errors(400, 401, 404, 413, 429, 500, 503),
    }


def ok(model: type[BaseModel] | None, description: str) -> dict[int | str, dict[str, Any]]:
    answer: dict[str, Any] = {"description": description, "headers": REQUEST_ID}
    if model is not None:
        answer["model"] = model
    return {200: answer}


Responses = dict[int | str, dict[str, Any]]  # a route's ``responses``, as FastAPI takes them
METRICS_RESPONSES: Responses = {
    200: {
        "description": "Prometheus text exposition format.",
        "headers": REQUEST_ID,
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}
HEALTH_RESPONSES: Responses = {
    200: {"model": Health, "description": "Serving.", "headers": REQUEST_ID},
    503: {"model": Health, "description": "No decode server in rotation, or draining.", "headers": REQUEST_ID},
    **errors(500),
}


def install(app: FastAPI, *, vocab_size: int, max_new_tokens: int, api_keys: bool) -> None:
    """Make ``app.openapi()`` (served at /openapi.json) this deployment's document (see the module's doc)."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                routes=app.routes,
                description="pdserve's OpenAI-compatible API. A method a route does not take is "
                "answered 405 in the same error shape, with `Allow`.",
            )
            app.openapi_schema = deployment(doc, vocab_size, max_new_tokens, api_keys)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]  # FastAPI's documented way to customise it


def deployment(doc: dict[str, Any], vocab_size: int, max_new_tokens: int, api_keys: bool) -> dict[str, Any]:
    """``doc`` without 422s, with this deployment's bounds and security written in."""
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for operations in doc["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if not api_keys:
                operation["responses"].pop("401", None)
            elif "401" in operation["responses"]:  # the routes that check an API key
                operation["security"] = [{"apiKey": []}]
    if api_keys:
        doc.setdefault("components", {})["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    bound(doc, vocab_size, max_new_tokens)
    return doc


def bound(node: Any, vocab_size: int, max_new_tokens: int) -> None:
    """Write the deployment's bounds into every marked schema node, in place."""
    if isinstance(node, list):
        for item in node:
            bound(item, vocab_size, max_new_tokens)
        return
    if not isinstance(node, dict):
        return
    if node.pop(TOKEN_ID, None):
        if node.get("type") == "integer":
            node.pop("exclusiveMaximum", None)
            node["maximum"] = vocab_size - 1
        else:
            node["pattern"] = decimal_below(vocab_size)
    if node.pop(MAX_NEW_TOKENS, None):
        for member in node.get("anyOf", [node]):
            if member.get("type") == "integer":
                member["maximum"] = max_new_tokens
    for value in node.values():
        bound(value, vocab_size, max_new_tokens)


def decimal_below(n: int) -> str:
    """A regular expression matching exactly the decimal numbers 0..n-1 (no sign, no leading zeros)."""
    assert n >= 1
    top = str(n - 1)
    shorter = ["[0-9]" if length == 1 else f"[1-9][0-9]{{{length - 1}}}" for length in range(1, len(top))]
    same = []  # numbers of top's length up to top: a prefix of top, then a smaller digit, then any digits
    for i, digit in enumerate(top):
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            same.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    same.append(top)
    return "^(?:" + "|".join(shorter + same) + ")$"
