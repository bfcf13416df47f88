"""Request limits: body size (413), prompt tokens and max_tokens (400).

``BodyLimitMiddleware`` reads at most ``max_bytes`` of a body before the app
sees any of it, so an oversized body costs the router that much memory and
no more: a declared Content-Length above the limit is refused before a byte
is read. ``RequestLimits`` caps what a request may ask of the engine, on top
of the model's context length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from router.api.model import ServedModel
from router.errors import OpenAIError, error_body


def openai_413(message: str) -> bytes:
    """The router's 413 body (server_common.guard.BodyCapMiddleware does the capping)."""
    return json.dumps(error_body(413, message, code="request_too_large")).encode()


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None  # also the default budget of a request that names none

    def completion_budget(
        self,
        model: ServedModel,
        num_prompt_tokens: int,
        requested: int | None,
        prompt_param: str,
        tokens_param: str = "max_tokens",
        explicit: bool = True,
    ) -> int:
        """The number of tokens to generate, or 400 (OpenAI's shape) when the request asks too much.

        ``explicit`` is False when ``requested`` is the API's default (16 for
        /v1/completions), which the cap lowers instead of refusing."""
        if self.max_prompt_tokens is not None and num_prompt_tokens > self.max_prompt_tokens:
            raise OpenAIError(
                400,
                f"the prompt has {num_prompt_tokens} tokens; this server accepts at most {self.max_prompt_tokens}",
                param=prompt_param,
                code="invalid_value",
            )
        if self.max_tokens is not None and requested is not None and requested > self.max_tokens:
            if not explicit:
                return model.check_fits(num_prompt_tokens, self.max_tokens, prompt_param)
            raise OpenAIError(
                400,
                f"{tokens_param} is too large: {requested}. This server supports at most "
                f"{self.max_tokens} completion tokens",
                param=tokens_param,
                code="invalid_value",
            )
        budget = model.check_fits(num_prompt_tokens, requested, prompt_param)
        return budget if self.max_tokens is None else min(budget, self.max_tokens)
