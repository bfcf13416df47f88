"""The OpenAI endpoints' logic, between the thin routes and the dispatcher.

Each handler validates and tokenizes, opens a dispatch ``Session`` per prompt
(so that "no room" or a dead cluster is an HTTP status, not a broken stream),
then either collects the whole answer or returns an async iterator of SSE
events, from the choices' deltas (router/api/fanout.py). The sessions are closed
in ``finally`` on every path, so a client that goes away or a stop string
aborts the request on the servers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TypedDict, TypeVar

import anyio
from fastapi.responses import Response

from engine.request import SamplingParams, StructuredSpec
from engine.structured import GrammarLimits
from router.access_log import AccessLog
from router.api import api_responses as out
from router.api.api_requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.api.choices import ChoiceDelta, TokenStrings
from router.api.fanout import Collected, Prepared, SessionGroup, choice_deltas
from router.api.grammar_check import GrammarChecker
from router.api.limits import RequestLimits
from router.api.logprob_shapes import CompletionLogprobsBuilder, chat_logprobs, prompt_logprobs
from router.api.model import ServedModel
from router.api.sse import DONE, ChunkTemplate, sse_event
from router.api.structured import one_constraint
from router.api.tool_calls import ToolCallStream, chat_message
from router.api.tools import plan_tools
from router.cluster import tenancy
from router.cluster.dispatch import Dispatcher, KVShareExceeded
from router.cluster.session import Session
from router.errors import OpenAIError
from router.metrics import FinishReason, RouterMetrics
from router.timeline import RequestTimeline
from server_common.timeline_log import TimelineLog
from server_common.tracing import Tracing, TracingSettings
from wire.replies import TokenLogprob

# Requests with a body longer than this (bytes) are checked, templated and tokenized on the handlers'
# tokenizer thread: a 4,600-token chat prompt takes ~8 ms (SmolLM2's tokenizer), and 100,000 empty
# messages or 2,000 tools take seconds of templating, which on the event loop would stall every
# stream in flight; a short request takes ~1 ms, less than handing it to a thread costs. The body
# counts, not the prompt's text: tools, message count and everything else add to the work.
LONG_REQUEST_BYTES = 8192


@dataclass
class Tally:
    """What a stream has sent so far: tokens per choice, and the first finish reason."""

    counts: dict[int, int] = field(default_factory=dict)
    reason: FinishReason | None = None

    @property
    def tokens(self) -> int:
        return sum(self.counts.values())


class _Given(TypedDict, total=False):
    """The sampling fields a request may leave out, as ``SamplingParams`` takes them."""

    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured: StructuredSpec | None = None,
) -> SamplingParams:
    """The request's sampling fields as the engine takes them (validated: see ``SamplingFields``).
    A field the request leaves out gets SamplingParams' default, written once there."""
    given = _Given()
    if req.presence_penalty is not None:
        given["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty is not None:
        given["frequency_penalty"] = req.frequency_penalty
    if req.repetition_penalty is not None:
        given["repetition_penalty"] = req.repetition_penalty
    if req.min_tokens is not None:
        given["min_tokens"] = req.min_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        logit_bias=tuple((int(token), bias) for token, bias in (req.logit_bias or {}).items()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        n=req.num_sequences,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
        **given,
    )


T = TypeVar("T")
# What ``chat`` and ``completion`` return: a stream of SSE events with the sessions it runs on (the caller closes
# them once the response ends), or the whole answer.
Answered = tuple[SessionGroup, AsyncIterator[str]] | tuple[None, Response]


def json_response(answer: out.ChatCompletion | out.Completion) -> Response:
    """A whole (not streamed) answer, encoded by pydantic in one pass."""
    return Response(answer.model_dump_json(), media_type="application/json")


def _most(*values: int | None) -> int | None:
    given = [v for v in values if v is not None]
    return max(given) if given else None


class OpenAIHandlers:
    def __init__(
        self,
        model: ServedModel,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
        limits: RequestLimits | None = None,
        tracing: Tracing | None = None,
        grammars: GrammarChecker | None = None,
        grammar_limits: GrammarLimits = GrammarLimits(),
        access: AccessLog | None = None,
    ) -> None:
        self.model = model
        self.access = access or AccessLog()
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.tracing = tracing or Tracing(TracingSettings(), "pdserve-router")
        self.timeline = TimelineLog()  # GET /debug/timeline
        self.token_strings = TokenStrings(model.tokenizer)
        # One thread: the tokenizer is only ever used by the event loop and this thread, with the same
        # settings (no truncation or padding), so no call changes its state under another.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # Answers with log-probabilities (megabytes of JSON for n 16 with 20 alternatives) are built and
        # encoded here, off the event loop; one thread, so that several at once cost one core.
        self._answer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="answers")
        self.grammars = grammars or GrammarChecker()  # started on the first grammar; shutdown() stops it
        self.grammar_limits = grammar_limits

    def shutdown(self) -> None:
        """The grammar sandbox's process and the handlers' threads stop (the router's lifespan ends)."""
        self.grammars.close()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self._answer_thread.shutdown(wait=False, cancel_futures=True)

    async def _prepare(self, prepare: Callable[[], Prepared], body_bytes: int) -> Prepared:
        """``prepare()`` on the event loop, or on the tokenizer thread for a long request; then the grammar
        it asks for, if any, compiled in the sandbox (router/api/grammar_check.py)."""
        if body_bytes < LONG_REQUEST_BYTES:
            p = prepare()
        else:
            p = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, prepare)
        if p.sampling.structured is not None:
            assert p.structured_param is not None  # the two come together (``_constraint``)
            await self.grammars.check(p.structured_param, p.sampling.structured)
        return p

    async def _answer(self, build: Callable[[], T], heavy: bool) -> T:
        """``build()`` on the answers thread when ``heavy`` (log-probabilities), else on the event loop."""
        if not heavy:
            return build()
        return await asyncio.get_running_loop().run_in_executor(self._answer_thread, build)

    def _constraint(self, constraints: list[tuple[str, StructuredSpec]]) -> tuple[str | None, StructuredSpec | None]:
        """The request's one constraint: its parameter and its grammar (None, None: none)."""
        found = one_constraint(constraints, self.grammar_limits)
        return (None, None) if found is None else found

    def models(self) -> out.ModelList:
        return out.ModelList(data=[self.model_card(self.model.name)])

    def model_card(self, model_id: str) -> out.ModelCard:
        """The served model's card, or 404 (``model_not_found``) for any other id."""
        m = self.model
        m.check_name(model_id)
        return out.ModelCard(id=m.name, created=m.created, root=m.root, max_model_len=m.max_model_len)

    # ---- preparing ---------------------------------------------------------

    def prepare_chat(
        self, req: ChatCompletionRequest, request_id: str, traceparent: str | None = None, endpoint: str = "chat"
    ) -> Prepared:
        """``endpoint``: what metrics and the timeline call it (``responses`` runs as chat)."""
        self.model.check_prompt_chars(sum(len(m.text()) for m in req.messages), "messages")
        self.model.check_name(req.model)
        req.check_supported()
        tools = plan_tools(req.tools, req.tool_choice, self.model.tools_in_template)
        param, structured = self._constraint(req.structured_constraints(self.grammar_limits) + tools.constraints)
        prompt = self.model.encode_chat(req.template_messages(), req.add_generation_prompt, tools.tools)
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.limits.completion_budget(
            self.model, len(prompt), req.max_new_tokens(), "messages", tokens_param
        )
        try:
            max_tokens = self.dispatcher.kv_budget(
                len(prompt), max_tokens, req.num_sequences, explicit=req.max_new_tokens() is not None
            )
        except KVShareExceeded as exc:
            raise exc.named(tokens_param) from None
        req.check_tokens(self.model.vocab_size, max_tokens)
        top = (req.top_logprobs or 0) if req.logprobs else None
        sampling = sampling_params(req, max_tokens, top, req.prompt_logprobs, structured)
        return Prepared(
            request_id,
            endpoint,
            [prompt],
            sampling,
            req.stop_strings(),
            self._timeline(request_id, traceparent, endpoint),
            top_logprobs=top,
            prompt_top=req.prompt_logprobs,
            tools=tools,
            structured_param=param,
        )

    def prepare_completion(self, req: CompletionRequest, request_id: str, traceparent: str | None = None) -> Prepared:
        texts = [req.prompt] if isinstance(req.prompt, str) else [x for x in req.prompt if isinstance(x, str)]
        self.model.check_prompt_chars(max(map(len, texts), default=0), "prompt")
        self.model.check_name(req.model)
        req.check_supported()
        param, structured = self._constraint(req.structured_constraints(self.grammar_limits))
        given = req.prompts()
        prompts = [self.model.encode_prompt(x) for x in given]
        requested = 1 if req.max_tokens == 0 else req.max_tokens
        explicit = "max_tokens" in req.model_fields_set
        budget = min(
            self.dispatcher.kv_budget(
                len(x),
                self.limits.completion_budget(self.model, len(x), requested, "prompt", explicit=explicit),
                req.num_sequences,
                explicit,
            )
            for x in prompts
        )
        req.check_tokens(self.model.vocab_size, budget)
        # With echo and logprobs the prompt tokens are scored too.
        prompt_top = _most(req.prompt_logprobs, req.logprobs if req.echo else None)
        prompt_texts = None
        if req.echo:
            prompt_texts = [
                x if isinstance(x, str) else self.model.tokenizer.decode(x, skip_special_tokens=True) for x in given
            ]
        sampling = sampling_params(req, budget, req.logprobs, prompt_top, structured)
        return Prepared(
            request_id,
            "completions",
            prompts,
            sampling,
            req.stop_strings(),
            self._timeline(request_id, traceparent, "completions"),
            prompt_texts=prompt_texts,
            top_logprobs=req.logprobs,
            prompt_top=req.prompt_logprobs,
            echo=req.echo,
            drop_generated=req.max_tokens == 0,
            structured_param=param,
        )

    def _timeline(self, request_id: str, traceparent: str | None, endpoint: str) -> RequestTimeline:
        return RequestTimeline(
            self.metrics, self.tracing, self.timeline, request_id, traceparent, self.access, endpoint
        )

    # ---- running -----------------------------------------------------------

    async def open(self, p: Prepared) -> list[Session]:
        """One session per prompt, opened together; if one cannot open, the others are closed."""
        ids = [p.request_id] if len(p.prompts) == 1 else [f"{p.request_id}-{j}" for j in range(len(p.prompts))]
        trace = p.timeline.traceparent
        max_tokens = len(p.prompts) * p.sampling.n * p.sampling.max_tokens
        try:  # its tokens as OpenAI counts them against a limit: the prompts, and max_tokens for each choice
            tenancy.CURRENT.get().take_tokens(p.num_prompt_tokens + max_tokens)
        except OpenAIError as refused:
            p.timeline.failed(refused.code or str(refused.status))
            p.timeline.close()
            raise
        p.timeline.came_in(p.num_prompt_tokens, max_tokens)
        opened = await asyncio.gather(
            *(
                self.dispatcher.start(rid, prompt, p.sampling, trace, prefer=p.prefer_decode)
                for rid, prompt in zip(ids, p.prompts)
            ),
            return_exceptions=True,
        )
        sessions = [x for x in opened if isinstance(x, Session)]
        failed = [x for x in opened if isinstance(x, BaseException)]
        if failed:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*(s.close() for s in sessions))
            exc = failed[0]
            p.timeline.failed(exc.code or str(exc.status) if isinstance(exc, OpenAIError) else "error")
            p.timeline.close()
            raise exc
        p.timeline.opened(p.num_prompt_tokens, local_prefill=sessions[0].reservation is None)
        return sessions

    async def close(self, p: Prepared, sessions: list[Session], count: int) -> None:
        # Shielded: after a client disconnect the scope is cancelled and any await would raise at once.
        with anyio.CancelScope(shield=True):
            await SessionGroup(sessions).close()
        p.timeline.close(sessions[0], count)

    async def collect(self, p: Prepared) -> tuple[list[Collected], list[Session]]:
        """Every choice's whole answer, in choice order."""
        sessions = await self.open(p)
        n = p.sampling.n
        got = [Collected() for _ in range(len(p.prompts) * n)]
        try:
            async for d in choice_deltas(p, sessions, self.model.tokenizer):
                got[d.index].add(d)
            self._finished(p, got)
            return got, sessions
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            raise
        finally:
            await self.close(p, sessions, sum(c.count for c in got))

    @staticmethod
    def _finished(p: Prepared, got: list[Collected]) -> None:
        p.timeline.finished(got[0].finish_reason or "length", sum(c.count for c in got))

    def _usage(self, p: Prepared, sessions: list[Session], completion_tokens: int) -> out.Usage:
        return out.Usage.of(p.num_prompt_tokens, completion_tokens, sum(s.cached_tokens for s in sessions))

    def _prompt_logprobs(
        self, p: Prepared, j: int, logprobs: Sequence[TokenLogprob | None] | None
    ) -> out.PromptLogprobs | None:
        if p.prompt_top is None or logprobs is None:
            return None
        return prompt_logprobs(p.prompts[j], logprobs, p.prompt_top, self.token_strings)

    async def chat(
        self, req: ChatCompletionRequest, request_id: str, traceparent: str | None = None, body_bytes: int = 0
    ) -> Answered:
        """``body_bytes``: the request body's length, which decides where it is prepared (``_prepare``)."""
        return await self._run(
            lambda: self.prepare_chat(req, request_id, traceparent),
            body_bytes,
            req.stream,
            lambda p, sessions: self._chat_stream(p, req, sessions),
            self._chat_answer,
        )

    async def completion(
        self, req: CompletionRequest, request_id: str, traceparent: str | None = None, body_bytes: int = 0
    ) -> Answered:
        """``body_bytes``: the request body's length, which decides where it is prepared (``_prepare``)."""
        return await self._run(
            lambda: self.prepare_completion(req, request_id, traceparent),
            body_bytes,
            req.stream,
            lambda p, sessions: self._completion_stream(p, req, sessions),
            self._completion_answer,
        )

    async def _run(
        self,
        prepare: Callable[[], Prepared],
        body_bytes: int,
        stream: bool,
        streamer: Callable[[Prepared, list[Session]], AsyncIterator[str]],
        answer: Callable[[Prepared, list[Collected], out.Usage], Response],
    ) -> Answered:
        """Prepare a request, then either open its sessions for ``streamer`` or collect them whole and
        have ``answer`` build the response (``_answer``: off the event loop when it is scored)."""
        p = await self._prepare(prepare, body_bytes)
        if stream:
            sessions = await self.open(p)
            return SessionGroup(sessions), streamer(p, sessions)
        got, sessions = await self.collect(p)
        usage = self._usage(p, sessions, sum(c.count for c in got))
        return None, await self._answer(lambda: answer(p, got, usage), p.scored)

    def _chat_answer(self, p: Prepared, got: list[Collected], usage: out.Usage) -> Response:
        choices = []
        for i, c in enumerate(got):
            message, reason = chat_message(c.text, c.finish_reason, p.tools.parse)
            logprobs = None if p.top_logprobs is None else chat_logprobs(c.tokens, p.top_logprobs, self.token_strings)
            choices.append(out.ChatChoice(index=i, message=message, finish_reason=reason, logprobs=logprobs))
        return json_response(
            out.ChatCompletion(
                id=f"chatcmpl-{p.request_id}",
                created=int(time.time()),
                model=self.model.name,
                choices=choices,
                usage=usage,
                prompt_logprobs=self._prompt_logprobs(p, 0, got[0].prompt_logprobs),
            )
        )

    def _completion_answer(self, p: Prepared, got: list[Collected], usage: out.Usage) -> Response:
        n = p.sampling.n
        choices = []
        for i, c in enumerate(got):
            logprobs = None
            if p.top_logprobs is not None:
                logprobs = CompletionLogprobsBuilder(p.top_logprobs, self.token_strings).build(c.tokens)
            choices.append(
                out.CompletionChoice(
                    index=i,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    logprobs=logprobs,
                    prompt_logprobs=self._prompt_logprobs(p, i // n, c.prompt_logprobs),
                )
            )
        return json_response(
            out.Completion(
                id=f"cmpl-{p.request_id}", created=int(time.time()), model=self.model.name, choices=choices, usage=usage
            )
        )

    # ---- streams -----------------------------------------------------------

    async def _framed(
        self,
        p: Prepared,
        sessions: list[Session],
        choices: AsyncGenerator[str, None],
        tally: Tally,
        usage_event: Callable[[out.Usage], str] | None,
    ) -> AsyncIterator[str]:
        """An SSE stream around its choices' events: the usage chunk when asked for and ``[DONE]``
        after them, an error event and ``[DONE]`` when one fails, the sessions closed either way
        (and when the client leaves), the request's end in its timeline."""
        try:
            async for event in choices:
                yield event
            p.timeline.finished(tally.reason or "length", tally.tokens)
            if usage_event is not None:
                yield usage_event(self._usage(p, sessions, tally.tokens))
            yield DONE
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            yield sse_event(exc.body())
            yield DONE
        finally:
            await choices.aclose()
            await self.close(p, sessions, tally.tokens)

    def _chat_stream(self, p: Prepared, req: ChatCompletionRequest, sessions: list[Session]) -> AsyncIterator[str]:
        tally, created = Tally(), int(time.time())

        def usage_event(usage: out.Usage) -> str:
            chunk = out.ChatCompletionChunk(
                id=f"chatcmpl-{p.request_id}", created=created, model=self.model.name, choices=[], usage=usage
            )
            return sse_event(chunk, exclude={"prompt_logprobs"})

        choices = self._chat_choices(p, req, sessions, tally, created)
        return self._framed(p, sessions, choices, tally, usage_event if req.include_usage else None)

    async def _chat_choices(
        self, p: Prepared, req: ChatCompletionRequest, sessions: list[Session], tally: Tally, created: int
    ) -> AsyncGenerator[str, None]:
        """Every choice's chunks: its role first, then text (through the tool-call parser when the
        answer may call tools), log-probabilities, its finish reason."""
        usage_field = {"prompt_logprobs"} | (set() if req.include_usage else {"usage"})

        def chunk(
            index: int,
            delta: out.Delta | out.ToolCallsDelta,
            finish_reason: FinishReason | None = None,
            logprobs: out.ChatLogprobs | None = None,
        ) -> out.ChatCompletionChunk:
            return out.ChatCompletionChunk(
                id=f"chatcmpl-{p.request_id}",
                created=created,
                model=self.model.name,
                choices=[out.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)],
            )

        templates: dict[int, ChunkTemplate] = {}
        calls: dict[int, ToolCallStream] = {}  # per choice, when the answer may call tools

        def content(index: int, text: str) -> str:
            if index not in templates:

                def make(t: str, _: FinishReason | None) -> out.ChatCompletionChunk:
                    return chunk(index, out.Delta(content=t))

                templates[index] = ChunkTemplate(make, usage_field)
            return templates[index].event(text)

        for i in range(len(p.prompts) * p.sampling.n):
            yield sse_event(chunk(i, out.Delta(role="assistant", content="")), exclude=usage_field)
        async for d in choice_deltas(p, sessions, self.model.tokenizer):
            tally.counts[d.index] = d.completion_tokens
            if d.prompt_logprobs is not None and p.prompt_top is not None and d.index == 0:  # one prompt

                def first_event(d: ChoiceDelta = d) -> str:
                    first = chunk(d.index, out.Delta(content=""))
                    first.prompt_logprobs = self._prompt_logprobs(p, 0, d.prompt_logprobs)
                    return sse_event(first, exclude=usage_field - {"prompt_logprobs"})

                yield await self._answer(first_event, heavy=True)
            logprobs = None
            if p.top_logprobs is not None and d.tokens:
                logprobs = chat_logprobs(d.tokens, p.top_logprobs, self.token_strings)
            if p.tools.parse:
                # Text through the call parser: content and call deltas in order; the tokens'
                # log-probabilities go in a chunk of their own.
                stream = calls.setdefault(d.index, ToolCallStream())
                for piece in stream.feed(d.text, d.finish_reason is not None):
                    if isinstance(piece, out.ToolCallsDelta):
                        yield sse_event(chunk(d.index, piece), exclude=usage_field)
                    elif piece:
                        yield content(d.index, piece)
                if logprobs is not None:
                    yield sse_event(chunk(d.index, out.Delta(), logprobs=logprobs), exclude=usage_field)
            elif logprobs is not None:
                yield sse_event(chunk(d.index, out.Delta(content=d.text), logprobs=logprobs), exclude=usage_field)
            elif d.text:
                yield content(d.index, d.text)
            if d.finish_reason:
                finish = calls[d.index].finish_reason(d.finish_reason) if d.index in calls else d.finish_reason
                tally.reason = tally.reason or finish
                yield sse_event(chunk(d.index, out.Delta(), finish), exclude=usage_field)

    def _completion_stream(self, p: Prepared, req: CompletionRequest, sessions: list[Session]) -> AsyncIterator[str]:
        tally, created = Tally(), int(time.time())

        def usage_event(usage: out.Usage) -> str:
            chunk = out.Completion(
                id=f"cmpl-{p.request_id}", created=created, model=self.model.name, choices=[], usage=usage
            )
            return sse_event(chunk)

        choices = self._completion_choices(p, req, sessions, tally, created)
        return self._framed(p, sessions, choices, tally, usage_event if req.include_usage else None)

    async def _completion_choices(
        self, p: Prepared, req: CompletionRequest, sessions: list[Session], tally: Tally, created: int
    ) -> AsyncGenerator[str, None]:
        """Every choice's chunks: text with its log-probabilities (and its prompt's, built off the
        event loop) when asked for, the last with its finish reason."""
        usage_field = None if req.include_usage else {"usage"}
        n = p.sampling.n

        def chunk(
            index: int,
            text: str,
            reason: FinishReason | None,
            logprobs: out.CompletionLogprobs | None = None,
            prompt_logprobs: out.PromptLogprobs | None = None,
        ) -> out.Completion:
            return out.Completion(
                id=f"cmpl-{p.request_id}",
                created=created,
                model=self.model.name,
                choices=[
                    out.CompletionChoice(
                        index=index, text=text, finish_reason=reason, logprobs=logprobs, prompt_logprobs=prompt_logprobs
                    )
                ],
            )

        templates: dict[int, ChunkTemplate] = {}
        builders: dict[int, CompletionLogprobsBuilder] = {}
        async for d in choice_deltas(p, sessions, self.model.tokenizer):
            tally.counts[d.index] = d.completion_tokens
            tally.reason = tally.reason or d.finish_reason
            if p.top_logprobs is not None or d.prompt_logprobs is not None:
                if d.index not in builders:
                    builders[d.index] = CompletionLogprobsBuilder(p.top_logprobs or 0, self.token_strings)
                builder = builders[d.index]

                def event(d: ChoiceDelta = d, builder: CompletionLogprobsBuilder = builder) -> str:
                    prompt = self._prompt_logprobs(p, d.index // n, d.prompt_logprobs)
                    logprobs = None if p.top_logprobs is None else builder.build(d.tokens)
                    return sse_event(chunk(d.index, d.text, d.finish_reason, logprobs, prompt), exclude=usage_field)

                # A prompt's log-probabilities are one big event: built off the loop.
                yield await self._answer(event, heavy=d.prompt_logprobs is not None)
                continue
            if d.index not in templates:
                templates[d.index] = ChunkTemplate(partial(chunk, d.index), usage_field)
            yield templates[d.index].event(d.text, d.finish_reason)
