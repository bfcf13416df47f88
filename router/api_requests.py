"""Client -> router: the OpenAI request bodies pdserve accepts.

Fields OpenAI defines but pdserve cannot honour yet (``n`` > 1, ``logprobs``,
``echo``, penalties, ...) are parsed so that ``check_supported`` can
refuse them with a clear 400 instead of silently ignoring them. Unknown fields
are ignored, as vLLM does, so SDKs that send newer arguments keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.errors import OpenAIError
from router.structured import StructuredFields
from router.tools import EarlierCall, template_message


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(StructuredFields):
    """Fields both endpoints share (the structured-output ones in router/structured.py)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 24)  # the ranges of server_common.worker_requests
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension, handy for benchmarks

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4:
            raise OpenAIError(400, "at most 4 stop sequences are supported", param="stop")
        if any(s == "" for s in stops):
            raise OpenAIError(400, "stop sequences must not be empty", param="stop")
        return stops

    def check_common(self) -> None:
        if self.n not in (None, 1):
            raise OpenAIError(400, "only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise OpenAIError(400, f"{name} is not supported", param=name)
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        self.check_common()
        if self.logprobs is not None:
            raise OpenAIError(400, "logprobs is not supported", param="logprobs")
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise OpenAIError(400, "only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request, as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[EarlierCall] | None = None  # an assistant's earlier calls (router/tools.py)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(400, f"content parts of type {part.type!r} are not supported", param="messages")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True  # vLLM extension

    def check_supported(self) -> None:
        self.check_common()
        if not self.messages:
            raise OpenAIError(400, "messages must not be empty", param="messages")
        if self.logprobs or self.top_logprobs:
            raise OpenAIError(400, "logprobs is not supported", param="logprobs")

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [template_message(m) for m in self.messages]
