"""A request's sessions (one per prompt) -> its choices' deltas.

A prepared request has one prompt per session and ``sampling.n`` sequences
each; prompt j's sequence i is choice j * n + i (as OpenAI numbers them).
The sessions run together and the first that fails fails the request (the
handlers close them all, which aborts the others). With echo or prompt
log-probabilities, each choice opens with a delta of its prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.request import SamplingParams
from router.api.choices import ChoiceDelta, ChoiceText, Scored
from router.api.tools import ToolPlan
from router.cluster.session import Session
from router.errors import OpenAIError
from router.metrics import FinishReason
from router.timeline import RequestTimeline
from wire.replies import TokenLogprob, TokensEvent


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
    sampling: SamplingParams
    stops: list[str]
    timeline: RequestTimeline
    prompt_texts: list[str] | None = None
    top_logprobs: int | None = None
    prompt_top: int | None = None
    echo: bool = False
    drop_generated: bool = False
    tools: ToolPlan = field(default_factory=ToolPlan)  # how the answer's tool calls are read (router/api/tools.py)
    structured_param: str | None = None  # the parameter that asked for ``sampling.structured``
    prefer_decode: str | None = None  # the decode server to try first (it holds the conversation's KV)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def scored(self) -> bool:
        """Log-probabilities asked for, of the answer or the prompt: its answer may be megabytes."""
        return self.top_logprobs is not None or self.prompt_top is not None


async def choice_deltas(p: Prepared, sessions: list[Session], tokenizer: Any) -> AsyncIterator[ChoiceDelta]:
    """Every choice's deltas (prompt j's sequence i is choice j * n + i, as OpenAI numbers
    them), the sessions running together; the first that fails fails the request."""
    if len(sessions) == 1:
        async for delta in _session_deltas(p, 0, sessions[0], tokenizer):
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(j: int, session: Session) -> None:
        try:
            async for delta in _session_deltas(p, j, session, tokenizer):
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


async def _session_deltas(p: Prepared, j: int, session: Session, tokenizer: Any) -> AsyncIterator[ChoiceDelta]:
    """One prompt's choices: detokenized, stop-string-cut text (and tokens, with logprobs asked for);
    with echo or prompt log-probabilities, each choice opens with a delta of its prompt."""
    n, prompt = p.sampling.n, p.prompts[j]
    choices = [ChoiceText(j * n + i, tokenizer, prompt, p.stops, p.top_logprobs is not None) for i in range(n)]
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
            for delta in _openings(p, j, choices, event.prompt_logprobs):
                yield delta
            opening = False
        for e in [*held, event]:
            generated = _generated(p, choices[e.index], e)
            if generated is not None:
                yield generated
        held = []
        if all(c.done for c in choices):
            return


def _openings(
    p: Prepared, j: int, choices: list[ChoiceText], logprobs: list[TokenLogprob | None] | None
) -> list[ChoiceDelta]:
    prompt = p.prompts[j]
    text = ""
    if p.echo:
        assert p.prompt_texts is not None  # given with echo (OpenAIHandlers.prepare_completion)
        text = p.prompt_texts[j]
    tokens = []
    if p.echo and p.top_logprobs is not None:
        scores = logprobs or [None] * len(prompt)
        tokens = [Scored(t, lp) for t, lp in zip(prompt, scores)]
    return [ChoiceDelta(c.index, text, tokens, None, 0, logprobs) for c in choices]


def _generated(p: Prepared, choice: ChoiceText, event: TokensEvent) -> ChoiceDelta | None:
    if event.finish_reason == "abort":
        raise OpenAIError(500, f"request {p.request_id} was aborted by the decode server")
    if event.finish_reason == "grammar":  # the client's grammar, not a fault of the servers (engine/scheduler.py)
        param = p.structured_param or "tools"
        raise OpenAIError(
            400,
            f"{param}: the grammar could not be followed after {choice.count} tokens (the matcher "
            "gave up: a grammar that forces unbounded text, is too ambiguous, or matches no text); "
            "simplify it",
            param=param,
        )
    if p.drop_generated:  # max_tokens 0: the one token drawn is not part of the answer
        if choice.done or event.finish_reason is None:
            return None
        choice.finish_reason = "length"
        return ChoiceDelta(choice.index, "", [], "length", 0)
    return choice.push(event)


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
    finish_reason: FinishReason | None = None
    count: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, d: ChoiceDelta) -> None:
        self.text += d.text
        self.tokens += d.tokens
        self.finish_reason = d.finish_reason or self.finish_reason
        self.count = d.completion_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
