"""The model the router serves: its name, folder, context length and tokenizer.

The router never loads weights: it needs the tokenizer (chat template,
tokenization, detokenization) and the context length, both from the same
local Hugging Face folder the servers load.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import transformers
from jinja2 import TemplateError

from router.api.fast_tokens import Encode, encoder
from router.api.tools import template_uses_tools
from router.errors import OpenAIError


def _chars_per_token(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters (byte-level entries spell each byte as one character, so
    this bounds the text's characters too), times 4 when a normalizer (or a tokenizer without a fast backend)
    may shorten text before it is split."""
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * (1 if backend is not None and backend.normalizer is None else 4)


def load_tokenizer(folder: str) -> Any:
    """The tokenizer ``AutoTokenizer`` would load, without its import of torch when the folder names
    its class: ``AutoTokenizer`` reads the model's config class, and transformers' config module
    imports torch (about half of the router's start). A folder that names no class, or one
    transformers does not export, goes through ``AutoTokenizer``."""
    settings = Path(folder) / "tokenizer_config.json"
    name = json.loads(settings.read_text()).get("tokenizer_class") if settings.is_file() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
        return cls.from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def max_position_embeddings(folder: str) -> int:
    """The model's context length from its config.json (through ``AutoConfig``, which imports torch,
    only when the file nests it elsewhere)."""
    value = json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(transformers.AutoConfig.from_pretrained(folder).max_position_embeddings)


@dataclass(frozen=True)
class ServedModel:
    name: str
    root: str  # the model folder, reported as /v1/models root (as vLLM does)
    max_model_len: int
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))
    tools_in_template: bool = False  # the chat template renders tools (router/api/tools.py)
    # The most characters of text one token stands for (its vocabulary's longest entry; 4 times that when
    # the tokenizer normalizes text first, since normalization may shorten it): see ``check_prompt_chars``.
    chars_per_token: int = 64

    @classmethod
    def load(cls, name: str, folder: str, max_model_len: int | None = None) -> ServedModel:
        tokenizer = load_tokenizer(folder)
        # the same rule as the engine: the configured length, capped by the model's
        limit = max_position_embeddings(folder)
        max_model_len = min(max_model_len or limit, limit)
        return cls(
            name=name,
            root=folder,
            max_model_len=max_model_len,
            tokenizer=tokenizer,
            tools_in_template=template_uses_tools(tokenizer),
            chars_per_token=_chars_per_token(tokenizer),
        )

    @cached_property
    def _encode_text(self) -> Encode:
        """A prompt's text -> ids, special tokens added (on the tokenizer's backend: router/api/fast_tokens.py)."""
        return encoder(self.tokenizer, add_special_tokens=True)

    @cached_property
    def _encode_templated(self) -> Encode:
        """A rendered chat template -> ids, which already holds its special tokens."""
        return encoder(self.tokenizer, add_special_tokens=False)

    @property
    def max_prompt_chars(self) -> int:
        """A text prompt longer than this cannot fit the context in any tokenization."""
        return self.max_model_len * self.chars_per_token

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """400 ``context_length_exceeded`` at once, before tokenizing, for text that can never fit: every
        token stands for at most ``chars_per_token`` characters, so such a text has more tokens than the
        context holds. (Tokenizing the 4 MiB a body may carry takes seconds.)"""
        if chars > self.max_prompt_chars:
            raise OpenAIError(
                400,
                f"the prompt has {chars} characters, more than {self.max_model_len} tokens "
                f"(this model's context) can hold at {self.chars_per_token} characters a token",
                param=param,
                code="context_length_exceeded",
            )

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name (prompt, logit_bias, stop_token_ids) are below this."""
        return len(self.tokenizer)

    def check_name(self, requested: str) -> None:
        if requested != self.name:
            raise OpenAIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Apply the chat template (with ``tools`` when given), then tokenize without adding special tokens again."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except TemplateError as exc:
            raise OpenAIError(400, f"chat template rejected the messages: {exc}", param="messages") from exc
        return self._encode_templated(text)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._encode_text(prompt)
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
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"for the completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens
