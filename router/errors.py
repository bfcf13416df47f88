"""OpenAI-shaped errors: one exception type, the JSON body and the handlers.

Every error the router returns looks like OpenAI's::

    {"error": {"message": "...", "type": "invalid_request_error",
               "param": "messages", "code": null}}

with the matching HTTP status, and every response carries ``X-Request-Id``
(500s repeat it in the message so a user can quote it).
"""

from __future__ import annotations

import json
import logging
import math
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error to show the client, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = headers or {}  # sent with the error (a rate limit's x-ratelimit-*)

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error"),
            "param": param,
            "code": code,
        }
    }


def request_id_of(request: Request) -> str:
    """The id of this HTTP request, made on first use (see ``RequestIdMiddleware``)."""
    state = request.scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = new_request_id()
    return state["request_id"]


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class RequestIdMiddleware:
    """Pure ASGI middleware (no buffering, so SSE and disconnects still work)
    that gives each request an id and echoes it in ``X-Request-Id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state.setdefault("request_id", new_request_id())
        header = (b"x-request-id", state["request_id"].encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), header])
            await send(message)

        await self.app(scope, receive, send_with_id)


def error_response(exc: OpenAIError) -> JSONResponse:
    headers = dict(exc.headers)
    if exc.retry_after is not None:  # whole seconds, rounded up: a client that waits as told is not early
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as 'field: message' and the field's dotted path."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # Of the errors about the first field, one from a union member whose type fits the input
    # ("at most 4 items" for a list of 5 stops, not "should be a string").
    field = errors[0].get("loc", ())[:2]
    first = next((e for e in errors if e.get("loc", ())[:2] == field and not e["type"].endswith("_type")), errors[0])
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return f"request body is not valid JSON: {detail}", None
    param = ".".join(p for p in loc if not is_union_member(p)) or None
    msg = first.get("msg", "invalid value")
    if param is None:
        return f"invalid request body: {msg}", None
    return f"{param}: {msg}", param


UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "constrained-str", "constrained-int"}


def is_union_member(part: str) -> bool:
    """Whether a step of a pydantic error's location names the member of a union that was tried
    (``prompt.list[int].0``, ``input.0.MessageItem.role``), not a field: the client's ``param`` is
    the field, ``prompt.0``. Field names in the API are lowercase identifiers, so a tag (``list[str]``,
    ``function-after[...]``, a model's class name) never shadows one."""
    return part in UNION_MEMBER_TAGS or "[" in part or "-" in part or (part[:1].isupper() and part.isidentifier())


def install_error_handlers(app: FastAPI) -> None:
    """Map every error the app can raise to OpenAI's shape."""

    # The decorator, not add_exception_handler: Starlette types each handler as taking any Exception, but calls it
    # only with its own class's.
    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc)
        return error_response(OpenAIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        response = error_response(OpenAIError(exc.status_code, message))
        if exc.status_code == 405 and exc.headers:  # Starlette names the route's methods in Allow
            message = f"{request.method} is not allowed on {request.url.path} (allowed: {exc.headers['Allow']})"
            response = error_response(OpenAIError(405, message, code="method_not_allowed"))
            response.headers["Allow"] = exc.headers["Allow"]
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id_of(request)
        log.exception("request %s failed", rid)
        return error_response(OpenAIError(500, f"internal server error (request id {rid})"))
