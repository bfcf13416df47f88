"""The OpenAI endpoints' logic, between the thin routes and the dispatcher.

Each handler validates and tokenizes, opens a dispatch ``Session`` (so that
"no room" or a dead cluster is an HTTP status, not a broken stream), then
either collects the whole answer or returns an async iterator of SSE events.
The session is closed in ``finally`` on every path, so a client that goes
away or a stop string aborts the request on the servers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import anyio

from router import api_responses as out
from router.api_requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.dispatch import Dispatcher
from router.session import Session
from router.errors import OpenAIError
from router.limits import RequestLimits
from router.metrics import RouterMetrics
from router.model import ServedModel
from router.sse import DONE, ChunkTemplate, sse_event
from router.structured import checked_spec
from router.textstream import IncrementalDetokenizer, StopMatcher
from router.timeline import RequestTimeline
from router.tool_calls import ToolCallStream, chat_message
from router.tools import ToolPlan, plan_tools
from server_common.timeline_log import TimelineLog
from server_common.tracing import Tracing, TracingSettings
from server_common.worker_requests import SamplingSpec


# Prompts longer than this (characters) are templated and tokenized on the handlers' tokenizer thread:
# a 4,600-token chat prompt takes ~8 ms (SmolLM2's tokenizer), which on the event loop would stall
# every stream in flight; a short one takes ~1 ms, less than handing it to a thread costs.
LONG_PROMPT_CHARS = 8192


@dataclass(frozen=True)
class TextDelta:
    text: str
    finish_reason: str | None  # "stop" | "length" on the last delta
    completion_tokens: int


@dataclass
class Prepared:
    """A validated request, ready to dispatch."""

    request_id: str
    endpoint: str
    prompt: list[int]
    sampling: SamplingSpec
    stops: list[str]
    timeline: RequestTimeline
    tools: ToolPlan = ToolPlan()


def sampling_spec(req: SamplingFields, max_tokens: int) -> SamplingSpec:
    """The request's sampling fields as the servers take them (validated: see ``SamplingFields``).
    A field the request leaves out gets SamplingSpec's default, written once there."""
    given = {name: value for name, value in (
        ("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty),
        ("repetition_penalty", req.repetition_penalty), ("min_tokens", req.min_tokens)) if value is not None}
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        logit_bias=tuple((int(token), bias) for token, bias in (req.logit_bias or {}).items()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        **given,
    )


class OpenAIHandlers:
    def __init__(self, model: ServedModel, dispatcher: Dispatcher, metrics: RouterMetrics,
                 limits: RequestLimits | None = None, tracing: Tracing | None = None) -> None:
        self.model = model
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.tracing = tracing or Tracing(TracingSettings(), "pdserve-router")
        self.timeline = TimelineLog()  # GET /debug/timeline
        # One thread: the tokenizer is only ever used by the event loop and this thread, with the same
        # settings (no truncation or padding), so no call changes its state under another.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _prepare(self, prepare: Callable[[], Prepared], prompt_chars: int) -> Prepared:
        """``prepare()`` on the event loop, or on the tokenizer thread for a long prompt."""
        if prompt_chars < LONG_PROMPT_CHARS:
            return prepare()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, prepare)

    def models(self) -> out.ModelList:
        return out.ModelList(data=[self.model_card(self.model.name)])

    def model_card(self, model_id: str) -> out.ModelCard:
        """The served model's card, or 404 (``model_not_found``) for any other id."""
        m = self.model
        m.check_name(model_id)
        return out.ModelCard(id=m.name, created=m.created, root=m.root, max_model_len=m.max_model_len)

    # ---- preparing ---------------------------------------------------------

    def prepare_chat(self, req: ChatCompletionRequest, request_id: str, traceparent: str | None = None) -> Prepared:
        self.model.check_name(req.model)
        req.check_supported()
        tools = plan_tools(req.tools, req.tool_choice, self.model.tools_in_template)
        structured = checked_spec(req.structured_constraints() + tools.constraints)
        prompt = self.model.encode_chat(req.template_messages(), req.add_generation_prompt, tools.tools)
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.limits.completion_budget(self.model, len(prompt), req.max_new_tokens(), "messages",
                                                   tokens_param)
        req.check_tokens(self.model.vocab_size, max_tokens)
        sampling = sampling_spec(req, max_tokens).model_copy(update={"structured": structured})
        return Prepared(request_id, "chat", prompt, sampling, req.stop_strings(),
                        self._timeline(request_id, traceparent), tools)

    def prepare_completion(self, req: CompletionRequest, request_id: str, traceparent: str | None = None) -> Prepared:
        self.model.check_name(req.model)
        req.check_supported()
        structured = checked_spec(req.structured_constraints())
        prompt = self.model.encode_prompt(req.single_prompt())
        max_tokens = self.limits.completion_budget(self.model, len(prompt), req.max_tokens, "prompt",
                                                   explicit="max_tokens" in req.model_fields_set)
        req.check_tokens(self.model.vocab_size, max_tokens)
        sampling = sampling_spec(req, max_tokens).model_copy(update={"structured": structured})
        return Prepared(request_id, "completions", prompt, sampling, req.stop_strings(),
                        self._timeline(request_id, traceparent))

    def _timeline(self, request_id: str, traceparent: str | None) -> RequestTimeline:
        return RequestTimeline(self.metrics, self.tracing, self.timeline, request_id, traceparent)

    # ---- running -----------------------------------------------------------

    async def open(self, p: Prepared) -> Session:
        try:
            session = await self.dispatcher.start(p.request_id, p.prompt, p.sampling, p.timeline.traceparent)
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            p.timeline.close()
            raise
        p.timeline.opened(len(p.prompt), local_prefill=session.reservation is None)
        return session

    async def text_deltas(self, p: Prepared, session: Session) -> AsyncIterator[TextDelta]:
        """Detokenized, stop-string-cut text; the last delta carries the finish reason."""
        detok = IncrementalDetokenizer(self.model.tokenizer, p.prompt)
        stops = StopMatcher(p.stops)
        timing = p.timeline
        count = 0
        async for event in session.deltas():
            timing.tokens(len(event.token_ids))
            count += len(event.token_ids)
            text = stops.push(detok.push(event.token_ids))
            if not stops.stopped and event.finish_reason is not None:
                text += stops.push(detok.flush())
                text += stops.flush()
            if stops.stopped:
                timing.finished("stop", count)
                yield TextDelta(text, "stop", count)
                break
            if event.finish_reason == "abort":
                raise OpenAIError(500, f"request {p.request_id} was aborted by the decode server")
            if event.finish_reason is not None:
                timing.finished(event.finish_reason, count)
                yield TextDelta(text, event.finish_reason, count)
                break
            if text:
                yield TextDelta(text, None, count)

    async def collect(self, p: Prepared) -> tuple[str, str, int, int]:
        """Text, finish reason, completion tokens, cached prompt tokens."""
        session = await self.open(p)
        parts, reason, count = [], "length", 0
        try:
            async for delta in self.text_deltas(p, session):
                parts.append(delta.text)
                reason = delta.finish_reason or reason
                count = delta.completion_tokens
            return "".join(parts), reason, count, session.cached_tokens
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            raise
        finally:
            # Shielded: after a client disconnect the scope is cancelled and any await would raise at once.
            with anyio.CancelScope(shield=True):
                await session.close()
            p.timeline.close(session, count)

    async def chat(self, req: ChatCompletionRequest, request_id: str, traceparent: str | None = None):
        chars = sum(len(m.text()) for m in req.messages)
        p = await self._prepare(lambda: self.prepare_chat(req, request_id, traceparent), chars)
        if req.stream:
            session = await self.open(p)
            return session, self._chat_stream(p, req, session)
        text, reason, count, cached = await self.collect(p)
        message, reason = chat_message(text, reason, p.tools.parse)
        return None, out.ChatCompletion(
            id=f"chatcmpl-{request_id}", created=int(time.time()), model=self.model.name,
            choices=[out.ChatChoice(message=message, finish_reason=reason)],
            usage=out.Usage.of(len(p.prompt), count, cached),
        )

    async def completion(self, req: CompletionRequest, request_id: str, traceparent: str | None = None):
        chars = len(req.prompt) if isinstance(req.prompt, str) else sum(len(x) for x in req.prompt
                                                                           if isinstance(x, str))
        p = await self._prepare(lambda: self.prepare_completion(req, request_id, traceparent), chars)
        if req.stream:
            session = await self.open(p)
            return session, self._completion_stream(p, req, session)
        text, reason, count, cached = await self.collect(p)
        return None, out.Completion(
            id=f"cmpl-{request_id}", created=int(time.time()), model=self.model.name,
            choices=[out.CompletionChoice(text=text, finish_reason=reason)],
            usage=out.Usage.of(len(p.prompt), count, cached),
        )

    # ---- streams -----------------------------------------------------------

    async def _chat_stream(self, p: Prepared, req: ChatCompletionRequest, session: Session) -> AsyncIterator[str]:
        usage_field = None if req.include_usage else {"usage"}

        def chunk(delta: out.Delta | out.ToolCallsDelta, finish_reason=None) -> out.ChatCompletionChunk:
            return out.ChatCompletionChunk(id=f"chatcmpl-{p.request_id}", created=created, model=self.model.name,
                                           choices=[out.ChatChunkChoice(delta=delta, finish_reason=finish_reason)])

        created = int(time.time())
        content = ChunkTemplate(lambda text, _: chunk(out.Delta(content=text)), usage_field)
        count = 0
        calls = ToolCallStream() if p.tools.parse else None
        try:
            yield sse_event(chunk(out.Delta(role="assistant", content="")), exclude=usage_field)
            async for d in self.text_deltas(p, session):
                count = d.completion_tokens
                pieces = [d.text] if calls is None else calls.feed(d.text, d.finish_reason is not None)
                for piece in pieces:
                    if isinstance(piece, out.ToolCallsDelta):
                        yield sse_event(chunk(piece), exclude=usage_field)
                    elif piece:
                        yield content.event(piece)
                if d.finish_reason:
                    reason = d.finish_reason if calls is None else calls.finish_reason(d.finish_reason)
                    yield sse_event(chunk(out.Delta(), reason), exclude=usage_field)
            if req.include_usage:
                usage = out.Usage.of(len(p.prompt), count, session.cached_tokens)
                yield sse_event(out.ChatCompletionChunk(id=f"chatcmpl-{p.request_id}", created=created,
                                                        model=self.model.name, choices=[], usage=usage))
            yield DONE
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            yield sse_event(exc.body())
            yield DONE
        finally:
            # Shielded: after a client disconnect the scope is cancelled and any await would raise at once.
            with anyio.CancelScope(shield=True):
                await session.close()
            p.timeline.close(session, count)

    async def _completion_stream(self, p: Prepared, req: CompletionRequest, session: Session) -> AsyncIterator[str]:
        usage_field = None if req.include_usage else {"usage"}
        created = int(time.time())
        chunks = ChunkTemplate(lambda text, reason: out.Completion(
            id=f"cmpl-{p.request_id}", created=created, model=self.model.name,
            choices=[out.CompletionChoice(text=text, finish_reason=reason)]), usage_field)
        count = 0
        try:
            async for d in self.text_deltas(p, session):
                count = d.completion_tokens
                yield chunks.event(d.text, d.finish_reason)
            if req.include_usage:
                usage = out.Usage.of(len(p.prompt), count, session.cached_tokens)
                yield sse_event(out.Completion(id=f"cmpl-{p.request_id}", created=created, model=self.model.name,
                                               choices=[], usage=usage))
            yield DONE
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            yield sse_event(exc.body())
            yield DONE
        finally:
            # Shielded: after a client disconnect the scope is cancelled and any await would raise at once.
            with anyio.CancelScope(shield=True):
                await session.close()
            p.timeline.close(session, count)
