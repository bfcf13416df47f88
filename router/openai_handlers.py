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
from dataclasses import dataclass, field

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
from router.choices import ChoiceDelta, ChoiceText, Scored, TokenStrings
from router.logprob_shapes import CompletionLogprobsBuilder, chat_logprobs, prompt_logprobs
from router.timeline import RequestTimeline
from server_common.timeline_log import TimelineLog
from server_common.tracing import Tracing, TracingSettings
from server_common.worker_replies import TokenLogprob, TokensEvent
from server_common.worker_requests import SamplingSpec


# Prompts longer than this (characters) are templated and tokenized on the handlers' tokenizer thread:
# a 4,600-token chat prompt takes ~8 ms (SmolLM2's tokenizer), which on the event loop would stall
# every stream in flight; a short one takes ~1 ms, less than handing it to a thread costs.
LONG_PROMPT_CHARS = 8192


@dataclass
class Prepared:
    """A validated request, ready to dispatch: one prompt per session, ``sampling.n`` choices each.

    ``top_logprobs``: the top ones per generated token the client asked for (None: no
    log-probabilities); ``prompt_top``: the same for the prompt (vLLM's ``prompt_logprobs``);
    ``echo``: the prompt's text (and its tokens' log-probabilities) comes first in each
    choice; ``drop_generated``: ``max_tokens`` 0 with echo (the engine draws one token, dropped).
    """

    request_id: str
    endpoint: str
    prompts: list[list[int]]
    sampling: SamplingSpec
    stops: list[str]
    timeline: RequestTimeline
    prompt_texts: list[str] | None = None
    top_logprobs: int | None = None
    prompt_top: int | None = None
    echo: bool = False
    drop_generated: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def sampling_spec(req: SamplingFields, max_tokens: int, logprobs: int | None = None,
                  prompt_logprobs: int | None = None) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        n=req.num_sequences,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _most(*values: int | None) -> int | None:
    given = [v for v in values if v is not None]
    return max(given) if given else None


class OpenAIHandlers:
    def __init__(self, model: ServedModel, dispatcher: Dispatcher, metrics: RouterMetrics,
                 limits: RequestLimits | None = None, tracing: Tracing | None = None) -> None:
        self.model = model
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.tracing = tracing or Tracing(TracingSettings(), "pdserve-router")
        self.timeline = TimelineLog()  # GET /debug/timeline
        self.token_strings = TokenStrings(model.tokenizer)
        # One thread: the tokenizer is only ever used by the event loop and this thread, with the same
        # settings (no truncation or padding), so no call changes its state under another.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _prepare(self, prepare: Callable[[], Prepared], prompt_chars: int) -> Prepared:
        """``prepare()`` on the event loop, or on the tokenizer thread for a long prompt."""
        if prompt_chars < LONG_PROMPT_CHARS:
            return prepare()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, prepare)

    def models(self) -> out.ModelList:
        m = self.model
        return out.ModelList(data=[out.ModelCard(id=m.name, created=m.created, root=m.root,
                                                 max_model_len=m.max_model_len)])

    # ---- preparing ---------------------------------------------------------

    def prepare_chat(self, req: ChatCompletionRequest, request_id: str, traceparent: str | None = None) -> Prepared:
        self.model.check_name(req.model)
        req.check_supported()
        prompt = self.model.encode_chat(req.template_messages(), req.add_generation_prompt)
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.limits.completion_budget(self.model, len(prompt), req.max_new_tokens(), "messages",
                                                   tokens_param)
        top = (req.top_logprobs or 0) if req.logprobs else None
        return Prepared(request_id, "chat", [prompt], sampling_spec(req, max_tokens, top, req.prompt_logprobs),
                        req.stop_strings(), self._timeline(request_id, traceparent), top_logprobs=top,
                        prompt_top=req.prompt_logprobs)

    def prepare_completion(self, req: CompletionRequest, request_id: str, traceparent: str | None = None) -> Prepared:
        self.model.check_name(req.model)
        req.check_supported()
        given = req.prompts()
        prompts = [self.model.encode_prompt(x) for x in given]
        requested = 1 if req.max_tokens == 0 else req.max_tokens
        budget = min(self.limits.completion_budget(self.model, len(x), requested, "prompt",
                                                   explicit="max_tokens" in req.model_fields_set) for x in prompts)
        # With echo and logprobs the prompt tokens are scored too.
        prompt_top = _most(req.prompt_logprobs, req.logprobs if req.echo else None)
        texts = None
        if req.echo:
            texts = [x if isinstance(x, str) else self.model.tokenizer.decode(x, skip_special_tokens=True)
                     for x in given]
        return Prepared(request_id, "completions", prompts, sampling_spec(req, budget, req.logprobs, prompt_top),
                        req.stop_strings(), self._timeline(request_id, traceparent), prompt_texts=texts,
                        top_logprobs=req.logprobs, prompt_top=req.prompt_logprobs, echo=req.echo,
                        drop_generated=req.max_tokens == 0)

    def _timeline(self, request_id: str, traceparent: str | None) -> RequestTimeline:
        return RequestTimeline(self.metrics, self.tracing, self.timeline, request_id, traceparent)

    # ---- running -----------------------------------------------------------

    async def open(self, p: Prepared) -> list[Session]:
        """One session per prompt, opened together; if one cannot open, the others are closed."""
        ids = [p.request_id] if len(p.prompts) == 1 else [f"{p.request_id}-{j}" for j in range(len(p.prompts))]
        trace = p.timeline.traceparent
        opened = await asyncio.gather(*(self.dispatcher.start(rid, prompt, p.sampling, trace)
                                        for rid, prompt in zip(ids, p.prompts)), return_exceptions=True)
        failed = [x for x in opened if isinstance(x, BaseException)]
        if failed:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*(s.close() for s in opened if isinstance(s, Session)))
            exc = failed[0]
            p.timeline.failed(exc.code or str(exc.status) if isinstance(exc, OpenAIError) else "error")
            p.timeline.close()
            raise exc
        p.timeline.opened(p.num_prompt_tokens, local_prefill=opened[0].reservation is None)
        return opened

    async def close(self, p: Prepared, sessions: list[Session], count: int) -> None:
        # Shielded: after a client disconnect the scope is cancelled and any await would raise at once.
        with anyio.CancelScope(shield=True):
            await SessionGroup(sessions).close()
        p.timeline.close(sessions[0], count)

    async def choice_deltas(self, p: Prepared, sessions: list[Session]) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas (prompt j's sequence i is choice j * n + i, as OpenAI numbers
        them), the sessions running together; the first that fails fails the request."""
        if len(sessions) == 1:
            async for delta in self._session_deltas(p, 0, sessions[0]):
                yield delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(j: int, session: Session) -> None:
            try:
                async for delta in self._session_deltas(p, j, session):
                    queue.put_nowait(delta)
                queue.put_nowait(None)
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(j, s)) for j, s in enumerate(sessions)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _session_deltas(self, p: Prepared, j: int, session: Session) -> AsyncIterator[ChoiceDelta]:
        """One prompt's choices: detokenized, stop-string-cut text (and tokens, with logprobs asked for);
        with echo or prompt log-probabilities, each choice opens with a delta of its prompt."""
        n, prompt = p.sampling.n, p.prompts[j]
        choices = [ChoiceText(j * n + i, self.model.tokenizer, prompt, p.stops, p.top_logprobs is not None)
                   for i in range(n)]
        opening = p.echo or p.prompt_top is not None
        scored = p.sampling.prompt_logprobs is not None
        held: list[TokensEvent] = []
        timing = p.timeline
        async for event in session.deltas():
            timing.tokens(len(event.token_ids))
            if opening:
                if scored and event.prompt_logprobs is None and not event.finish_reason:
                    held.append(event)  # the prompt's log-probabilities come with sequence 0's first event
                    continue
                for delta in self._openings(p, j, choices, event.prompt_logprobs):
                    yield delta
                opening = False
            for e in [*held, event]:
                delta = self._generated(p, choices[e.index], e)
                if delta is not None:
                    yield delta
            held = []
            if all(c.done for c in choices):
                return

    def _openings(self, p: Prepared, j: int, choices: list[ChoiceText],
                  logprobs: list[TokenLogprob | None] | None) -> list[ChoiceDelta]:
        prompt = p.prompts[j]
        text = p.prompt_texts[j] if p.echo else ""
        tokens = []
        if p.echo and p.top_logprobs is not None:
            scores = logprobs or [None] * len(prompt)
            tokens = [Scored(t, lp) for t, lp in zip(prompt, scores)]
        return [ChoiceDelta(c.index, text, tokens, None, 0, logprobs) for c in choices]

    @staticmethod
    def _generated(p: Prepared, choice: ChoiceText, event: TokensEvent) -> ChoiceDelta | None:
        if event.finish_reason == "abort":
            raise OpenAIError(500, f"request {p.request_id} was aborted by the decode server")
        if p.drop_generated:  # max_tokens 0: the one token drawn is not part of the answer
            if choice.done or event.finish_reason is None:
                return None
            choice.finish_reason = "length"
            return ChoiceDelta(choice.index, "", [], "length", 0)
        return choice.push(event)

    async def collect(self, p: Prepared) -> tuple[list[Collected], list[Session]]:
        """Every choice's whole answer, in choice order."""
        sessions = await self.open(p)
        n = p.sampling.n
        got = [Collected() for _ in range(len(p.prompts) * n)]
        try:
            async for d in self.choice_deltas(p, sessions):
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

    def _prompt_logprobs(self, p: Prepared, j: int, logprobs) -> out.PromptLogprobs | None:
        if p.prompt_top is None or logprobs is None:
            return None
        return prompt_logprobs(p.prompts[j], logprobs, p.prompt_top, self.token_strings)

    async def chat(self, req: ChatCompletionRequest, request_id: str, traceparent: str | None = None):
        chars = sum(len(m.text()) for m in req.messages)
        p = await self._prepare(lambda: self.prepare_chat(req, request_id, traceparent), chars)
        if req.stream:
            sessions = await self.open(p)
            return SessionGroup(sessions), self._chat_stream(p, req, sessions)
        got, sessions = await self.collect(p)
        choices = [out.ChatChoice(
            index=i, message=out.AssistantMessage(content=c.text), finish_reason=c.finish_reason,
            logprobs=None if p.top_logprobs is None else chat_logprobs(c.tokens, p.top_logprobs, self.token_strings))
            for i, c in enumerate(got)]
        return None, out.ChatCompletion(
            id=f"chatcmpl-{request_id}", created=int(time.time()), model=self.model.name, choices=choices,
            usage=self._usage(p, sessions, sum(c.count for c in got)),
            prompt_logprobs=self._prompt_logprobs(p, 0, got[0].prompt_logprobs))

    async def completion(self, req: CompletionRequest, request_id: str, traceparent: str | None = None):
        chars = len(req.prompt) if isinstance(req.prompt, str) else sum(len(x) for x in req.prompt
                                                                           if isinstance(x, str))
        p = await self._prepare(lambda: self.prepare_completion(req, request_id, traceparent), chars)
        if req.stream:
            sessions = await self.open(p)
            return SessionGroup(sessions), self._completion_stream(p, req, sessions)
        got, sessions = await self.collect(p)
        n = p.sampling.n
        choices = []
        for i, c in enumerate(got):
            logprobs = None
            if p.top_logprobs is not None:
                logprobs = CompletionLogprobsBuilder(p.top_logprobs, self.token_strings).build(c.tokens)
            choices.append(out.CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                                logprobs=logprobs,
                                                prompt_logprobs=self._prompt_logprobs(p, i // n, c.prompt_logprobs)))
        return None, out.Completion(
            id=f"cmpl-{request_id}", created=int(time.time()), model=self.model.name, choices=choices,
            usage=self._usage(p, sessions, sum(c.count for c in got)),
        )

    # ---- streams -----------------------------------------------------------

    async def _chat_stream(self, p: Prepared, req: ChatCompletionRequest,
                           sessions: list[Session]) -> AsyncIterator[str]:
        usage_field = {"prompt_logprobs"} | (set() if req.include_usage else {"usage"})
        created = int(time.time())

        def chunk(index: int, delta: out.Delta, finish_reason=None, logprobs=None) -> out.ChatCompletionChunk:
            return out.ChatCompletionChunk(id=f"chatcmpl-{p.request_id}", created=created, model=self.model.name,
                                           choices=[out.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                                        finish_reason=finish_reason)])

        templates = {}
        counts: dict[int, int] = {}
        reason = None
        try:
            for i in range(len(p.prompts) * p.sampling.n):
                yield sse_event(chunk(i, out.Delta(role="assistant", content="")), exclude=usage_field)
            async for d in self.choice_deltas(p, sessions):
                counts[d.index] = d.completion_tokens
                if d.prompt_logprobs is not None and p.prompt_top is not None:
                    first = chunk(d.index, out.Delta(content=""))
                    first.prompt_logprobs = self._prompt_logprobs(p, 0, d.prompt_logprobs)
                    yield sse_event(first, exclude=usage_field - {"prompt_logprobs"})
                if p.top_logprobs is not None and d.tokens:
                    logprobs = chat_logprobs(d.tokens, p.top_logprobs, self.token_strings)
                    yield sse_event(chunk(d.index, out.Delta(content=d.text), logprobs=logprobs), exclude=usage_field)
                elif d.text:
                    if d.index not in templates:
                        index = d.index
                        templates[index] = ChunkTemplate(lambda text, _, i=index: chunk(i, out.Delta(content=text)),
                                                         usage_field)
                    yield templates[d.index].event(d.text)
                if d.finish_reason:
                    reason = reason or d.finish_reason
                    yield sse_event(chunk(d.index, out.Delta(), d.finish_reason), exclude=usage_field)
            p.timeline.finished(reason or "length", sum(counts.values()))
            if req.include_usage:
                usage = self._usage(p, sessions, sum(counts.values()))
                yield sse_event(out.ChatCompletionChunk(id=f"chatcmpl-{p.request_id}", created=created,
                                                        model=self.model.name, choices=[], usage=usage),
                                exclude={"prompt_logprobs"})
            yield DONE
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            yield sse_event(exc.body())
            yield DONE
        finally:
            await self.close(p, sessions, sum(counts.values()))

    async def _completion_stream(self, p: Prepared, req: CompletionRequest,
                                 sessions: list[Session]) -> AsyncIterator[str]:
        usage_field = None if req.include_usage else {"usage"}
        created = int(time.time())
        n = p.sampling.n

        def chunk(index: int, text: str, reason: str | None, **fields) -> out.Completion:
            return out.Completion(id=f"cmpl-{p.request_id}", created=created, model=self.model.name,
                                  choices=[out.CompletionChoice(index=index, text=text, finish_reason=reason,
                                                                **fields)])

        templates = {}
        builders: dict[int, CompletionLogprobsBuilder] = {}
        counts: dict[int, int] = {}
        reason = None
        try:
            async for d in self.choice_deltas(p, sessions):
                counts[d.index] = d.completion_tokens
                reason = reason or d.finish_reason
                if p.top_logprobs is not None or d.prompt_logprobs is not None:
                    builder = builders.setdefault(d.index, CompletionLogprobsBuilder(p.top_logprobs or 0,
                                                                                     self.token_strings))
                    fields = {"prompt_logprobs": self._prompt_logprobs(p, d.index // n, d.prompt_logprobs)}
                    if p.top_logprobs is not None:
                        fields["logprobs"] = builder.build(d.tokens)
                    yield sse_event(chunk(d.index, d.text, d.finish_reason, **fields), exclude=usage_field)
                    continue
                if d.index not in templates:
                    index = d.index
                    templates[index] = ChunkTemplate(lambda text, r, i=index: chunk(i, text, r), usage_field)
                yield templates[d.index].event(d.text, d.finish_reason)
            p.timeline.finished(reason or "length", sum(counts.values()))
            if req.include_usage:
                usage = self._usage(p, sessions, sum(counts.values()))
                yield sse_event(out.Completion(id=f"cmpl-{p.request_id}", created=created, model=self.model.name,
                                               choices=[], usage=usage))
            yield DONE
        except OpenAIError as exc:
            p.timeline.failed(exc.code or str(exc.status))
            yield sse_event(exc.body())
            yield DONE
        finally:
            await self.close(p, sessions, sum(counts.values()))


@dataclass(frozen=True)
class SessionGroup:
    """A request's sessions (one per prompt), closed together (idempotent, as ``Session.close``)."""

    sessions: list[Session]

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sessions))


@dataclass
class Collected:
    """One choice's whole answer, from its deltas."""

    text: str = ""
    tokens: list[Scored] = field(default_factory=list)
    finish_reason: str | None = None
    count: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, d: ChoiceDelta) -> None:
        self.text += d.text
        self.tokens += d.tokens
        self.finish_reason = d.finish_reason or self.finish_reason
        self.count = d.completion_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
