"""Client -> router: the OpenAI request bodies pdserve accepts.

Fields OpenAI defines but pdserve cannot honour yet (penalties, tools, ...) are parsed so that ``check_supported`` can
refuse them with a clear 400 instead of silently ignoring them. Unknown fields
are ignored, as vLLM does, so SDKs that send newer arguments keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.errors import OpenAIError
from server_common.worker_requests import MAX_LOGPROBS, MAX_N


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 24)  # the ranges of server_common.worker_requests
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM extension
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
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise OpenAIError(400, f"{name} is not supported", param=name)
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    @property
    def num_sequences(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_PROMPTS = 64  # choices (prompts times n) of one completion request


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: with echo, the scored prompt only
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        self.check_common()
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
        if self.best_of not in (None, 1):
            raise OpenAIError(400, "only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each as text or token ids (a list of them: one choice each)."""
        prompt = self.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if any(len(p) == 0 for p in prompts):
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        if len(prompts) * self.num_sequences > MAX_PROMPTS:
            raise OpenAIError(400, f"at most {MAX_PROMPTS} choices (prompts times n) per request", param="prompt")
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def check_supported(self) -> None:
        self.check_common()
        if not self.messages:
            raise OpenAIError(400, "messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.tools:
            raise OpenAIError(400, "tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise OpenAIError(400, "only response_format type 'text' is supported", param="response_format")

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
