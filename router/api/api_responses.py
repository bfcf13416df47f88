"""Router -> client: OpenAI response bodies and stream chunks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# Defined in router/metrics.py, as a metric's label: metrics sits below both halves, so it cannot import this module.
from router.metrics import FinishReason


class Answer(BaseModel):
    """Every field is always sent (nulls too), so the published schema marks every field required."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class PromptTokensDetails(Answer):
    cached_tokens: int = 0  # prompt tokens whose KV the serving side reused from its prefix cache


class Usage(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(Answer):
    """A token of chat ``logprobs.content[i].top_logprobs``."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Answer):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(Answer):
    """A completion choice's ``logprobs`` (the legacy shape): one entry per token; the
    first echoed prompt token has no log-probability (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Answer):
    """vLLM's ``prompt_logprobs`` entry; ``rank`` (1 = most likely) is null for a prompt
    token outside the top ones asked for."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's ``prompt_logprobs``: per prompt token, token id -> its entry (null for the first token)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(Answer):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension


class Completion(Answer):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(Answer):
    role: Literal["assistant"] = "assistant"
    content: str


class FunctionCall(Answer):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(Answer):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallMessage(Answer):
    """An answer that calls tools (router/api/tools.py): ``content`` is the text outside the calls, or null."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall]


class ChatChoice(Answer):
    index: int = 0
    message: AssistantMessage | ToolCallMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(Answer):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension (one prompt per chat request)


class Delta(Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None


class FunctionCallDelta(Answer):
    name: str | None = None
    arguments: str


class ToolCallDelta(Answer):
    """A piece of call ``index``: its first has the id, type and name, the next ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ToolCallsDelta(Answer):
    tool_calls: list[ToolCallDelta]


class ChatChunkChoice(Answer):
    index: int = 0
    delta: Delta | ToolCallsDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(Answer):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension: on the first chunk, when asked for


class ModelCard(Answer):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(Answer):
    object: Literal["list"] = "list"
    data: list[ModelCard]
