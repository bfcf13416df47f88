"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, with the served model's tokenizer.

Evaluation harnesses and tooling probe them to count tokens exactly as the server will. ``/tokenize``
takes a ``prompt`` (tokenized as ``/v1/completions`` does: special tokens added unless
``add_special_tokens`` is false) or chat ``messages`` (through the chat template, as
``/v1/chat/completions`` does) and answers ``{"count", "max_model_len", "tokens"}``;
``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.api.api_requests import MAX_MESSAGES, ChatMessage, TokenIdValue
from router.api.model import ServedModel
from router.api.tools import template_message
from router.errors import OpenAIError

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize call


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={  # _one_input's rule: a prompt or messages, not both
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
    )
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: Annotated[list[TokenIdValue], Field(max_length=MAX_DETOKENIZE)]


def tokenize_answer(model: ServedModel, req: TokenizeRequest) -> dict[str, Any]:
    if req.model is not None:
        model.check_name(req.model)
    if req.messages is not None:
        model.check_prompt_chars(sum(len(m.text()) for m in req.messages), "messages")
        tokens = model.encode_chat([template_message(m) for m in req.messages], req.add_generation_prompt)
    else:
        assert req.prompt is not None  # one of the two (_one_input)
        model.check_prompt_chars(len(req.prompt), "prompt")
        tokens = list(model.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    return {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}


def detokenize_answer(model: ServedModel, req: DetokenizeRequest) -> dict[str, Any]:
    if req.model is not None:
        model.check_name(req.model)
    bad = [t for t in req.tokens if t >= model.vocab_size]
    if bad:
        raise OpenAIError(
            400, f"token id {bad[0]} is outside the vocabulary (0..{model.vocab_size - 1})", param="tokens"
        )
    return {"prompt": model.tokenizer.decode(req.tokens)}
