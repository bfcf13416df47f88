"""One choice's text and log-probabilities, as a sequence's token events arrive.

A request has ``n`` sequences per prompt; each is one OpenAI choice with its
own detokenizer and stop-string matcher (router/api/textstream.py). When the
client asked for log-probabilities, every token goes with the text it adds,
so that a chunk carries the log-probabilities of the tokens whose text it
carries, and a stop string cuts both alike: a token whose text starts before
the cut is kept (its text is, at least in part), the others are dropped.

Token strings are those vLLM reports: the decode of the single token id;
``bytes`` are its UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.api.textstream import IncrementalDetokenizer, StopMatcher
from router.metrics import FinishReason
from wire.replies import TokenLogprob, TokensEvent


@dataclass(frozen=True)
class Scored:
    """A token and its log-probability (None for the prompt's first token: nothing precedes it)."""

    token_id: int
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice adds: ``text``, the ``tokens`` it comes from (when log-probabilities
    were asked for) and, on its last delta, the finish reason; ``completion_tokens``: the
    sequence's generated tokens so far (all of them, a stop string's too)."""

    index: int
    text: str
    tokens: list[Scored]
    finish_reason: FinishReason | None
    completion_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a choice's opening delta, when asked for


class TokenStrings:
    """Token id -> its string, decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = self._tokenizer.decode([token_id])
        return text


class ChoiceText:
    """One sequence's events -> its choice's deltas."""

    def __init__(self, index: int, tokenizer: Any, prompt: Sequence[int], stops: Sequence[str], scored: bool) -> None:
        self.index = index
        self._detok = IncrementalDetokenizer(tokenizer, prompt)
        self._stops = StopMatcher(stops)
        self._scored = scored  # log-probabilities asked for: tokens travel with their text
        self._pending: list[tuple[int, Scored]] = []  # (where its text starts in the decoded text, token)
        self._decoded = 0  # characters decoded so far
        self._emitted = 0  # characters returned so far (the stop matcher holds back the rest)
        self.count = 0
        self.finish_reason: FinishReason | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, event: TokensEvent) -> ChoiceDelta | None:
        """The delta this event makes (None when it adds nothing yet, or the choice is done)."""
        if self.done:
            return None
        self.count += len(event.token_ids)
        final = event.finish_reason is not None
        if self._scored:
            text = ""
            logprobs: Sequence[TokenLogprob | None] = event.logprobs or [None] * len(event.token_ids)
            for token, logprob in zip(event.token_ids, logprobs):
                self._pending.append((self._decoded, Scored(token, logprob)))
                piece = self._detok.push([token])
                self._decoded += len(piece)
                text += piece
        else:
            text = self._detok.push(event.token_ids)
        if final:
            tail = self._detok.flush()
            self._decoded += len(tail)
            text += tail
        out = self._stops.push(text)
        if final and not self._stops.stopped:
            out += self._stops.flush()
        self._emitted += len(out)
        if self._stops.stopped:
            self.finish_reason = "stop"
            tokens = [s for start, s in self._pending if start < self._emitted]
            self._pending = []
        elif final:
            reason = event.finish_reason
            assert reason == "stop" or reason == "length", reason  # abort and grammar: raised by fanout._generated
            self.finish_reason = reason
            tokens, self._pending = [s for _, s in self._pending], []
        else:
            tokens = self._release()
        if not (out or tokens or self.done):
            return None
        return ChoiceDelta(self.index, out, tokens, self.finish_reason, self.count)

    def _release(self) -> list[Scored]:
        """The pending tokens whose text is all out (a token's text ends where the next one's
        starts), up to the last one that added text: a token that added none yet (the first
        bytes of a character) waits for the text it is part of."""
        ends = [start for start, _ in self._pending[1:]] + [self._decoded]
        cut = 0
        for k, (start, _) in enumerate(self._pending):
            if ends[k] > self._emitted:
                break
            if ends[k] > start:
                cut = k + 1
        out = [s for _, s in self._pending[:cut]]
        del self._pending[:cut]
        return out
