"""``/v1/responses``: OpenAI's Responses API over the chat path, with stored, chained conversations.

A request becomes a chat request (router/api/api_requests.py), so it is validated, templated,
constrained (``text.format``, forced tool calls) and dispatched exactly as chat is, prefill and
decode on separate servers included:

- ``instructions`` is a system message first; ``input`` is a string (one user message) or a list
  of items: messages (roles user, system, developer, assistant; text content), ``function_call``
  items (an earlier call: an assistant message's tool call) and ``function_call_output`` items (a
  tool message answering it);
- ``previous_response_id`` puts that stored response's conversation (every earlier turn's input and
  output; not its instructions, as OpenAI) before this turn's input, and prefers the decode server
  that answered it, which holds the conversation's KV in its prefix cache;
- ``tools`` are function tools (Responses' flat shape), ``tool_choice`` none, auto, required or one
  function; ``text.format`` text, json_object or json_schema; ``max_output_tokens``,
  ``temperature``, ``top_p``, ``seed``.

The answer's output is a message item with one ``output_text`` part and/or ``function_call`` items,
the usage in input/output tokens. Streamed, it is OpenAI's typed events (``response.created`` ...
``response.completed``), which reassemble to the same response. ``store`` (default true) keeps it
(router/api/response_store/) for ``GET``, ``DELETE`` and ``input_items``, visible only to the API
key that made it. ``background: true`` (with ``store``) answers at once and runs the response in a task
of the router's, its events kept for ``GET ?stream=true&starting_after=N`` and stopped by ``cancel``
(router/api/background.py). Fields that would change the answer and are not supported (``include``,
``reasoning``, ``truncation: auto``, ``conversation``, ``prompt``, ``top_logprobs``,
``max_tool_calls``, ``parallel_tool_calls: false``, non-function tools, non-text input parts) are a
400 naming them.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from router.api import api_responses as out
from router.api.api_requests import MAX_TOOLS, NEW_TOKENS, AtLeast1, ChatCompletionRequest, Seed
from router.api.background import BackgroundRuns, Begin, EventLimits, Replay, RowFor, Run
from router.api.fanout import Collected, Prepared, SessionGroup, choice_deltas
from router.api.openai_handlers import Answered, OpenAIHandlers
from router.api.response_store import ResponseStore, StoredResponse
from router.api.response_store.base import Event, KeptCaller
from router.api.tool_calls import ToolCallStream, chat_message
from router.cluster import tenancy
from router.cluster.session import Session
from router.errors import OpenAIError
from router.metrics import FinishReason

MAX_METADATA = 16  # keys, as OpenAI
MAX_INPUT_ITEMS = 8192
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
Strict = ConfigDict(extra="ignore", strict=True)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = Strict
    format: TextFormat | None = None


class TextPart(BaseModel):
    """The content parts supported: text (images, audio and files are not)."""

    model_config = Strict
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = Strict
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made earlier (from a stored response's output, or written by the client)."""

    model_config = Strict
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model to read."""

    model_config = Strict
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(BaseModel):
    model_config = Strict
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Fields OpenAI defines that would change the answer and that pdserve does not
    honour take only the value that means "not used" (as ``suffix`` on completions), so asking for more
    is a 400 naming the field, and the published schema says so."""

    model_config = Strict
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool | None = None  # answer at once, run in the router (needs store)
    max_output_tokens: AtLeast1 | None = Field(default=None, json_schema_extra=NEW_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: Seed | None = None  # an extension, as on chat
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None
    text: TextConfig | None = None
    # As OpenAI: at most 16 pairs, keys of at most 64 characters, values of at most 512.
    metadata: (
        Annotated[dict[MetadataKey, Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)] | None
    ) = None
    user: str | None = None
    # Not supported: only the value that asks for nothing.
    parallel_tool_calls: Literal[True] | None = Field(default=None, description="an answer may call several tools")
    truncation: Literal["disabled"] | None = Field(default=None, description="auto is not supported")
    include: Annotated[list[str], Field(max_length=0)] | None = Field(default=None, description="not supported")
    reasoning: None = Field(default=None, description="not supported")
    conversation: None = Field(default=None, description="not supported: use previous_response_id")
    prompt: None = Field(default=None, description="not supported")
    top_logprobs: Literal[0] | None = Field(default=None, description="not supported")
    max_tool_calls: None = Field(default=None, description="not supported")


# What the chat path calls a parameter, and what this API calls it (errors name the client's field).
CHAT_PARAMS = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
)


def responses_param(param: str | None) -> str | None:
    for chat, ours in CHAT_PARAMS:
        if param is not None and (param == chat or param.startswith((chat + ".", chat + "["))):
            return ours + param[len(chat) :]
    return param


def renamed(exc: OpenAIError) -> OpenAIError:
    """``exc`` from the chat path, naming this API's field in its ``param`` and message."""
    chat_param, ours = exc.param, responses_param(exc.param)
    if chat_param is not None and ours is not None and ours != chat_param:
        exc.param, exc.message = ours, exc.message.replace(chat_param.split(".")[0], ours.split(".")[0])
    return exc


# ---- input items -> chat messages -----------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def normalize_items(given: str | list[InputItem]) -> list[dict[str, Any]]:
    """This turn's input as items with ids, as ``input_items`` lists them."""
    if isinstance(given, str):
        return [_message_item("user", given)]
    items = []
    for item in given:
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "".join(part.text for part in item.content)
            items.append(_message_item(item.role, text, item.id))
        else:
            prefix = "fc" if isinstance(item, FunctionCallItem) else "fco"
            items.append({"id": item.id or _item_id(prefix), **item.model_dump(exclude={"id"}), "status": "completed"})
    return items


def _message_item(role: str, text: str, item_id: str | None = None) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": text}
    if kind == "output_text":
        part["annotations"] = []
    return {
        "id": item_id or _item_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [part],
    }


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: consecutive function calls become one assistant message's tool calls."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _chat_tools(tools: list[FunctionTool] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    return [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in tools]


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    if text is None or text.format is None or text.format.type == "text":
        return None
    f = text.format
    if f.type == "json_object":
        return {"type": "json_object"}
    if not f.name:
        raise OpenAIError(400, "text.format of type json_schema needs a name", param="text.format.name")
    schema = {"name": f.name, "schema": f.schema_, "strict": f.strict, "description": f.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request this response runs as: instructions, the stored conversation, this turn."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages + chat_messages(items),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "response_format": _response_format(req.text),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise OpenAIError(400, f"{where}: {error['msg']}", param=where) from None


# ---- the answer ---------------------------------------------------------------------------------


def output_items(request_id: str, text: str, finish_reason: FinishReason | None, parse: bool) -> list[dict[str, Any]]:
    """The answer's items: a message with its text (if any, or if there is no call), then each call.
    Ids follow from the request id and the position, so a stream and its final response agree."""
    message, _ = chat_message(text, finish_reason, parse)
    items = []
    calls = message.tool_calls if isinstance(message, out.ToolCallMessage) else []
    if message.content or not calls:
        items.append(_answer_message(request_id, 0, message.content or "", "completed"))
    for call in calls:
        items.append(_call_item(request_id, len(items), call.id, call.function.name, call.function.arguments))
    return items


def _answer_message(request_id: str, index: int, text: str, status: str) -> dict[str, Any]:
    return {
        "id": f"msg_{request_id}_{index}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
    }


def _call_item(request_id: str, index: int, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "id": f"fc_{request_id}_{index}",
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class Turn:
    """One response in the making: the request, what it continues, and what it is built from."""

    req: ResponsesRequest
    response_id: str
    owner: str
    items: list[dict[str, Any]]  # this turn's input items
    history: list[dict[str, Any]]  # the stored conversation it continues (chat messages)
    created_at: float = field(default_factory=time.time)
    run: Run | None = None  # a background response's: its rows are written by its writer, in order

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: out.Usage | None,
        model: str,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        r = self.req
        fmt = (
            r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else {"type": "text"}
        )
        return {
            "id": self.response_id,
            "object": "response",
            "background": bool(r.background),
            "created_at": self.created_at,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "completed_at": time.time() if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": r.previous_response_id,
            "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "text": {"format": fmt},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "truncation": "disabled",
            "metadata": r.metadata or {},
            "user": r.user,
            "usage": None if usage is None else _usage(usage),
        }

    def conversation(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What the next turn continues: the history, this turn's input and its output."""
        return self.history + chat_messages(self.items) + chat_messages(output)


def _usage(u: out.Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class ResponsesHandler:
    """The Responses endpoints, over the chat handlers and a store."""

    def __init__(self, handlers: OpenAIHandlers, store: ResponseStore, limits: EventLimits | None = None) -> None:
        self.handlers = handlers
        self.store = store
        self.runs = BackgroundRuns(store, limits or EventLimits())
        self.runs.carry_on = self._carry_on
        # The router's tenants: whom an adopted response runs for (None: no tenant is known, ``UNATTRIBUTED``).
        self.tenancy: tenancy.Tenancy | None = None
        self.runs.with_output = lambda conversation, output: conversation + chat_messages(output)

    async def create(
        self, req: ResponsesRequest, owner: str, request_id: str, traceparent: str | None = None, body_bytes: int = 0
    ) -> Answered:
        """``owner``: who may read it back (response_store.owner_of the request's API key)."""
        if req.background and not req.store:
            raise OpenAIError(400, "background: true needs store: true", param="background", code="invalid_value")
        history, prefer = [], None
        if req.previous_response_id is not None:
            previous = await asyncio.to_thread(self.store.get, req.previous_response_id, owner)
            if previous is None:
                raise OpenAIError(
                    404,
                    f"no stored response with id {req.previous_response_id!r}",
                    param="previous_response_id",
                    code="not_found",
                )
            if previous.response.get("status") in ("queued", "in_progress"):
                raise OpenAIError(
                    400,
                    f"response {req.previous_response_id!r} is still {previous.response['status']}: "
                    "continue it once it ends",
                    param="previous_response_id",
                )
            history, prefer = previous.conversation, previous.decode_worker
        if req.background and req.seed is None and req.temperature != 0:
            # Seeded, so that a router adopting it (its own gone) runs it again to the same text.
            req = req.model_copy(update={"seed": secrets.randbelow(2**31)})
        turn = Turn(req, f"resp_{request_id}", owner, normalize_items(req.input), history)
        h = self.handlers
        try:
            chat = chat_request(req, history, turn.items)
            p = await h._prepare(lambda: h.prepare_chat(chat, request_id, traceparent, "responses"), body_bytes)
        except OpenAIError as exc:  # named as the chat path calls it: renamed to this API's field
            raise renamed(exc) from None
        p.prefer_decode = prefer
        if req.background:
            return await self._background(turn, p)
        if req.stream:
            sessions = await h.open(p)
            return SessionGroup(sessions), self._stream(turn, p, sessions)
        got, sessions = await h.collect(p)
        answer = await self._finish(turn, p, got[0], sessions)
        return None, Response(json.dumps(answer), media_type="application/json")

    async def _finish(self, turn: Turn, p: Prepared, got: Collected, sessions: list[Session]) -> dict[str, Any]:
        """The whole response, stored when asked."""
        output = output_items(p.request_id, got.text, got.finish_reason, p.tools.parse)
        usage = self.handlers._usage(p, sessions, got.count)
        answer = turn.response("completed", output, usage, self.handlers.model.name, got.finish_reason == "length")
        if turn.req.store:
            decode = sessions[0].decode.name if sessions and sessions[0].decode is not None else None
            stored = StoredResponse(
                turn.response_id,
                turn.owner,
                turn.created_at,
                answer,
                turn.items,
                turn.conversation(output),
                decode,
            )
            if turn.run is not None:
                turn.run.add(stored)
            else:
                await asyncio.to_thread(self.store.put, stored)
        return answer

    async def _background(self, turn: Turn, p: Prepared) -> Answered:
        """Stores the response ``queued`` and starts it in a task of the router's; answers the response
        (or, with ``stream``, its events as they come)."""
        begin, row = self._runner(turn, p, None)
        queued = row("queued", [], None)
        request = turn.req.model_dump_json(exclude_unset=True, by_alias=True)
        await self.runs.start(queued, begin, row, request, self._kept_caller())
        if turn.req.stream:
            return SessionGroup([]), self.runs.events(turn.response_id, turn.owner, None)
        return None, Response(json.dumps(queued.response), media_type="application/json")

    @staticmethod
    def _kept_caller() -> KeptCaller | None:
        """The request's tenant and priority class, by name, kept so that a router adopting it runs it for
        them (None when the request has no configured tenant)."""
        caller = tenancy.CURRENT.get()
        if caller.tenancy is None or not caller.ticket.counted:
            return None
        return KeptCaller(caller.ticket.tenant, caller.tenancy.class_of(caller.ticket))

    def _runner(
        self, turn: Turn, p: Prepared, replay: Replay | None, caller: tenancy.Caller | None = None
    ) -> tuple[Begin, RowFor]:
        """How a background response runs: what opens its sessions and gives its events, and its row for
        a status (``replay``: the text its log has, for a response carried on; ``caller``: whom that one
        runs for, set in its own task)."""
        model = self.handlers.model.name

        def row(status: str, output: list[dict[str, Any]], error: dict[str, Any] | None) -> StoredResponse:
            answer = {**turn.response(status, output, None, model), "error": error}
            conversation = turn.conversation(output)
            return StoredResponse(turn.response_id, turn.owner, turn.created_at, answer, turn.items, conversation)

        async def begin(run: Run) -> AsyncGenerator[str, None]:
            turn.run = run
            if caller is not None:  # in the run's task: its context is its own
                tenancy.CURRENT.set(caller)
            sessions = await self.handlers.open(p)
            return self._stream(turn, p, sessions, replay)

        return begin, row

    async def _carry_on(self, stored: StoredResponse, logged: list[Event]) -> tuple[Begin, RowFor] | None:
        """How this router runs again a background response whose router is gone, from its kept request;
        None when it cannot be (no request kept, or tool calls to parse out of its text)."""
        kept = await asyncio.to_thread(self.store.request_of, stored.id)
        if kept is None:
            return None
        caller = await self._adopted_caller(stored.id)
        req = ResponsesRequest.model_validate_json(kept)
        this_turn = chat_messages(stored.input_items)  # the conversation stored is the history, then these
        history = stored.conversation[: len(stored.conversation) - len(this_turn)]
        turn = Turn(req, stored.id, stored.owner, stored.input_items, history, stored.created_at)
        request_id = stored.id.removeprefix("resp_")
        h = self.handlers
        chat = chat_request(req, history, turn.items)
        token = tenancy.CURRENT.set(caller)  # not the reader's that found it: its tokens were counted once
        try:
            p = await h._prepare(lambda: h.prepare_chat(chat, request_id, None, "responses"), len(kept))
        finally:
            tenancy.CURRENT.reset(token)
        if p.tools.parse:
            p.timeline.close()
            return None
        return self._runner(turn, p, Replay.of(logged), caller)

    async def _adopted_caller(self, response_id: str) -> tenancy.Caller:
        """Whom an adopted response runs for: the tenant and class kept with its request, as this router
        configures them; ``UNATTRIBUTED`` when none was kept (an older router's) or none is configured."""
        kept = await asyncio.to_thread(self.store.caller_of, response_id)
        if kept is None or self.tenancy is None:
            return tenancy.Caller(tenancy.UNATTRIBUTED)
        return self.tenancy.carried_on(kept.tenant, kept.priority_class)

    async def _stream(
        self, turn: Turn, p: Prepared, sessions: list[Session], replay: Replay | None = None
    ) -> AsyncGenerator[str, None]:
        """The response's events. ``replay``: the text its log already has (a background response run
        again by the router that adopted it), cut into the pieces it was logged in."""
        model = self.handlers.model.name
        events = OutputEvents(p.request_id)
        got = Collected()
        calls = ToolCallStream() if p.tools.parse else None
        try:
            yield events.event("response.created", response=turn.response("in_progress", [], None, model))
            yield events.event("response.in_progress", response=turn.response("in_progress", [], None, model))
            async for d in choice_deltas(p, sessions, self.handlers.model.tokenizer):
                got.add(d)
                texts = [d.text] if replay is None else replay.feed(d.text)
                pieces: list[Any] = texts if calls is None else calls.feed(d.text, d.finish_reason is not None)
                for piece in pieces:
                    if isinstance(piece, out.ToolCallsDelta):
                        for e in (e for c in piece.tool_calls for e in events.call(c)):
                            yield e
                    elif piece:
                        for e in events.text(piece):
                            yield e
            if replay is not None:
                replay.end()
            if events.index < 0:  # no text and no call: an empty message, as the whole response has
                for e in events.text(""):
                    yield e
            for e in events.close_item():
                yield e
            p.timeline.finished(got.finish_reason or "length", got.count)
            answer = await self._finish(turn, p, got, sessions)
            yield events.event("response.completed", response=answer)
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            yield events.event("error", code=exc.code, message=exc.message, param=exc.param)
        finally:
            await self.handlers.close(p, sessions, got.count)

    async def get(self, response_id: str, owner: str) -> StoredResponse:
        """The stored response; a background one whose router is gone ends ``failed`` first."""
        return await self.runs.poll(response_id, owner)

    async def events(self, response_id: str, owner: str, starting_after: int | None) -> AsyncIterator[str]:
        """A background response's events after ``starting_after`` (checked first: 404, 400)."""
        await self.runs.check_stream(await self.get(response_id, owner), starting_after)
        return self.runs.events(response_id, owner, starting_after)

    async def cancel(self, response_id: str, owner: str) -> dict[str, Any]:
        return await self.runs.cancel(response_id, owner)

    async def shutdown(self) -> None:
        """The router stops: the background responses it runs end (``failed``)."""
        await self.runs.shutdown()

    async def delete(self, response_id: str, owner: str) -> dict[str, Any]:
        """A background response still running is stopped first (else its ending would store it again)."""
        stored = await self.get(response_id, owner)
        if stored.response.get("background") and stored.response["status"] in ("queued", "in_progress"):
            await self.runs.cancel(response_id, owner)
        if not await asyncio.to_thread(self.store.delete, response_id, owner):
            raise OpenAIError(404, f"no stored response with id {response_id!r}", param="response_id", code="not_found")
        return {"id": response_id, "object": "response", "deleted": True}


class OutputEvents:
    """A streamed response's events: numbered in order (``sequence_number``), and its output items,
    a message or a function call each, opened, filled and closed one after another."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._seq = 0
        self.index = -1  # the open output item's
        self._open: str | None = None  # "message" or "call"
        self._text = ""
        self._call: dict[str, Any] = {}

    def event(self, kind: str, **fields: Any) -> str:
        self._seq += 1
        return _sse({"type": kind, "sequence_number": self._seq - 1, **fields})

    def close_item(self) -> list[str]:
        """The open item's closing events (none open: none)."""
        rid, index, events = self._request_id, self.index, []
        if self._open == "message":
            part = {"type": "output_text", "text": self._text, "annotations": []}
            item_id = f"msg_{rid}_{index}"
            fields = dict(item_id=item_id, output_index=index, content_index=0)
            events.append(self.event("response.output_text.done", **fields, text=self._text, logprobs=[]))
            events.append(self.event("response.content_part.done", **fields, part=part))
            item = _answer_message(rid, index, self._text, "completed")
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        elif self._open == "call":
            call = self._call
            item = _call_item(rid, index, call["call_id"], call["name"], call["arguments"])
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=call["name"],
                    arguments=call["arguments"],
                )
            )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        self._open = None
        return events

    def text(self, piece: str) -> list[str]:
        """Answer text: into the open message, or a new one (closing a call before it)."""
        events = []
        if self._open != "message":
            events += self.close_item()
            self.index += 1
            self._open, self._text = "message", ""
            item = _answer_message(self._request_id, self.index, "", "in_progress")
            events.append(self.event("response.output_item.added", output_index=self.index, item=item))
            part = {"type": "output_text", "text": "", "annotations": []}
            fields = dict(item_id=item["id"], output_index=self.index, content_index=0)
            events.append(self.event("response.content_part.added", **fields, part=part))
        self._text += piece
        item_id = f"msg_{self._request_id}_{self.index}"
        fields = dict(item_id=item_id, output_index=self.index, content_index=0)
        events.append(self.event("response.output_text.delta", **fields, delta=piece, logprobs=[]))
        return events

    def call(self, delta: out.ToolCallDelta) -> list[str]:
        """A function call's delta: a new call item when it carries an id, else more arguments."""
        events = []
        if delta.id is not None:
            events += self.close_item()
            self.index += 1
            self._open = "call"
            self._call = {"call_id": delta.id, "name": delta.function.name or "", "arguments": ""}
            item = _call_item(self._request_id, self.index, delta.id, self._call["name"], "", "in_progress")
            events.append(self.event("response.output_item.added", output_index=self.index, item=item))
        if delta.function.arguments:
            self._call["arguments"] += delta.function.arguments
            item_id = f"fc_{self._request_id}_{self.index}"
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=self.index,
                    delta=delta.function.arguments,
                )
            )
        return events
