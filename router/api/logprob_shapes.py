"""Tokens with their log-probabilities (router/api/choices.py) -> the OpenAI and vLLM shapes.

Chat: ``logprobs.content``, one entry per token with its ``top_logprobs``
(the ``top_logprobs`` most likely, as asked for). Completions (the legacy
shape): ``tokens``, ``token_logprobs``, ``top_logprobs`` (the most likely
``logprobs`` tokens, and the chosen one, as OpenAI says: up to logprobs + 1)
and ``text_offset``, each token's offset in the choice's text counted as the
lengths of the token strings before it (as vLLM counts). vLLM's
``prompt_logprobs``: per prompt token, its id and the top ones' -> logprob,
rank, decoded token.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.api import api_responses as out
from router.api.choices import Scored, TokenStrings
from wire.replies import TokenLogprob


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: Sequence[Scored], top: int, strings: TokenStrings) -> out.ChatLogprobs:
    content = []
    for s in tokens:
        token = strings(s.token_id)
        lp = s.logprob
        tops = (
            []
            if lp is None
            else [out.TopLogprob(token=strings(t), logprob=v, bytes=_utf8(strings(t))) for t, v in lp.top[:top]]
        )
        content.append(
            out.ChatTokenLogprob(token=token, logprob=lp.logprob if lp else 0.0, bytes=_utf8(token), top_logprobs=tops)
        )
    return out.ChatLogprobs(content=content)


class CompletionLogprobsBuilder:
    """One completion choice's legacy ``logprobs``, chunk by chunk: ``text_offset`` runs on."""

    def __init__(self, top: int, strings: TokenStrings) -> None:
        self._top = top
        self._strings = strings
        self._offset = 0

    def build(self, tokens: Sequence[Scored]) -> out.CompletionLogprobs:
        result = out.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for s in tokens:
            token = self._strings(s.token_id)
            result.tokens.append(token)
            result.text_offset.append(self._offset)
            self._offset += len(token)
            lp = s.logprob
            if lp is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(lp.logprob)
            tops = {self._strings(t): v for t, v in lp.top[: self._top]}
            tops.setdefault(token, lp.logprob)
            result.top_logprobs.append(tops)
        return result


def prompt_logprobs(
    prompt: Sequence[int], logprobs: Sequence[TokenLogprob | None], top: int, strings: TokenStrings
) -> out.PromptLogprobs:
    """vLLM's list: None for the first prompt token, then the token's own entry and its top ``top``."""
    result: out.PromptLogprobs = []
    for token, lp in zip(prompt, logprobs):
        if lp is None:
            result.append(None)
            continue
        ranks = {t: rank for rank, (t, _) in enumerate(lp.top, start=1)}
        entry = {str(token): out.PromptLogprob(logprob=lp.logprob, rank=ranks.get(token), decoded_token=strings(token))}
        for rank, (t, v) in enumerate(lp.top[:top], start=1):
            entry.setdefault(str(t), out.PromptLogprob(logprob=v, rank=rank, decoded_token=strings(t)))
        result.append(entry)
    return result
