"""The model the router serves: its name, folder, context length and tokenizer.

The router never loads weights: it needs the tokenizer (chat template,
tokenization, detokenization) and the context length, both from the same
local Hugging Face folder the servers load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from transformers import AutoConfig, AutoTokenizer

from router.errors import OpenAIError
from router.tools import template_uses_tools


@dataclass(frozen=True)
class ServedModel:
    name: str
    root: str  # the model folder, reported as /v1/models root (as vLLM does)
    max_model_len: int
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))
    tools_in_template: bool = False  # the chat template renders tools (router/tools.py)

    @classmethod
    def load(cls, name: str, folder: str, max_model_len: int | None = None) -> ServedModel:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        # the same rule as the engine: the configured length, capped by the model's
        limit = int(AutoConfig.from_pretrained(folder).max_position_embeddings)
        max_model_len = min(max_model_len or limit, limit)
        return cls(name=name, root=folder, max_model_len=max_model_len, tokenizer=tokenizer,
                   tools_in_template=template_uses_tools(tokenizer))

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name (prompt, logit_bias, stop_token_ids) are below this."""
        return len(self.tokenizer)

    def check_name(self, requested: str) -> None:
        if requested != self.name:
            raise OpenAIError(404, f"The model `{requested}` does not exist.", param="model",
                              code="model_not_found")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Apply the chat template (with ``tools`` when given), then tokenize without adding special tokens again."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except TemplateError as exc:
            raise OpenAIError(400, f"chat template rejected the messages: {exc}", param="messages") from exc
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        vocab = self.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        return list(prompt)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        """Return max_tokens (filled in when None) or raise 400 when the request cannot fit."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens. Please reduce the length of the prompt.",
                param=param, code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"for the completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded",
            )
        return max_tokens
