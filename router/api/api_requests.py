"""Client -> router: the OpenAI request bodies pdserve accepts.

Fields OpenAI defines but pdserve does not honour (``best_of`` other than
``n``, ``suffix``, content parts other than text) are parsed with the values
it takes as the only valid ones, so that asking for more is a clear 400
instead of being silently ignored, and the published schema says so. Unknown
fields are ignored, as vLLM does, so SDKs that send newer arguments keep
working.

Known fields are validated strictly (``strict=True``: ``"0.5"`` is not a
temperature, ``"true"`` not a boolean; an integer is a valid number), so the
published JSON schema says exactly what is accepted, and every range is in
the schema too: a value outside it is a 400 naming the field
(router/errors.py maps validation errors to OpenAI's shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic.config import JsonDict

from engine.request import MAX_LOGPROBS, MAX_N, MAX_STOP_TOKEN_IDS
from router.api.openapi import MAX_NEW_TOKENS, TOKEN_ID
from router.api.structured import StructuredFields
from router.api.tools import EarlierCall, template_message
from router.errors import OpenAIError

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13


def _integral(value: Any) -> Any:
    """JSON's 16.0 is the integer 16 (as JSON Schema says): accepted where an integer is, 16.5 is not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integral = BeforeValidator(_integral)  # after an integer's bounds: Annotated[int, Field(ge=0), Integral]


# The integers JSON carries exactly everywhere (I-JSON, RFC 7493): a seed beyond them would be
# rounded by many clients, and by the tools that read the published schema.
JSON_EXACT = (1 << 53) - 1
MAX_STOP = 4  # stop sequences, as OpenAI
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
# Token ids: their bound below the vocabulary size is checked by router.api.model and written into the
# published schema by router.api.openapi (the marks).
TokenKey = Annotated[
    str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,9})$"), Field(json_schema_extra={TOKEN_ID: True})
]  # a token id, in decimal
NonEmpty = Annotated[str, StringConstraints(min_length=1)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TokenIdValue = Annotated[int, Field(ge=0, lt=1 << 31, json_schema_extra={TOKEN_ID: True}), Integral]
NEW_TOKENS: JsonDict = {MAX_NEW_TOKENS: True}  # bounded in the published schema by the context and router.max_tokens
# The integer fields' types: their bounds (``ge``, ``lt``, ...) are in the type, not in the field's
# ``Field()``, so that the JSON schema states them (as ``minimum``, ...).
AtLeast0 = Annotated[int, Field(ge=0), Integral]
AtLeast1 = Annotated[int, Field(ge=1), Integral]
TopK = Annotated[int, Field(ge=-1, le=1 << 24), Integral]  # the ranges of wire.requests
Seed = Annotated[int, Field(ge=-JSON_EXACT, le=JSON_EXACT), Integral]
NumSequences = Annotated[int, Field(ge=1, le=MAX_N), Integral]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class SamplingFields(StructuredFields):
    """Fields both endpoints share (the structured-output ones in router/api/structured.py)."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            # check_common's rule, for the schema: stream_options only with stream true
            "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
            "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        },
    )

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP)] | None = None
    n: NumSequences | None = 1  # sequences sampled from one prefill
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[TokenKey, Bias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None  # accepted and ignored: pdserve keeps no per-user state
    # vLLM extensions
    ignore_eos: bool = False  # handy for benchmarks
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)  # 1 = off
    min_tokens: AtLeast0 | None = Field(default=None, json_schema_extra=NEW_TOKENS)  # <= the max_tokens
    stop_token_ids: list[TokenIdValue] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    prompt_logprobs: NumLogprobs | None = None

    @field_validator("logit_bias", mode="wrap")
    @classmethod
    def _one_logit_bias_error(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One message naming ``logit_bias`` (pydantic's would name a key inside it)."""
        try:
            return handler(value)
        except ValidationError as exc:
            raise ValueError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids (decimal strings) to "
                f"numbers in [-100, 100]: {exc.errors()[0]['msg']}"
            ) from None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def check_tokens(self, vocab_size: int, max_tokens: int) -> None:
        """What the schema cannot say: token ids within this model's vocabulary, and
        ``min_tokens`` within the request's budget (``max_tokens`` as filled in)."""
        for key in self.logit_bias or {}:
            if int(key) >= vocab_size:
                raise OpenAIError(
                    400,
                    f"logit_bias names token id {key}, outside the vocabulary (0..{vocab_size - 1})",
                    param="logit_bias",
                )
        for token in self.stop_token_ids or []:
            if token >= vocab_size:
                raise OpenAIError(
                    400,
                    f"stop_token_ids has token id {token}, outside the vocabulary (0..{vocab_size - 1})",
                    param="stop_token_ids",
                )
        if self.min_tokens is not None and self.min_tokens > max_tokens:
            raise OpenAIError(
                400,
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({max_tokens})",
                param="min_tokens",
                code="invalid_value",
            )

    @property
    def num_sequences(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_PROMPTS = 64  # choices (prompts times n) of one completion request


def _several_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> TypeIs[list[str] | list[list[int]]]:
    """A list of prompts (texts or token id lists), not one prompt (a text or token ids)."""
    return isinstance(prompt, list) and isinstance(prompt[0], (str, list))


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    # text or token ids, or a list of them: one choice (times n) per prompt
    prompt: (
        NonEmpty
        | Annotated[list[TokenIdValue], Field(min_length=1)]
        | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[
            list[Annotated[list[TokenIdValue], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)
        ]
    )
    max_tokens: AtLeast0 | None = Field(default=16, json_schema_extra=NEW_TOKENS)  # 0: only with echo
    logprobs: NumLogprobs | None = None
    echo: bool = False
    best_of: NumSequences | None = Field(default=None, description="must equal n")
    suffix: None = Field(default=None, description="not supported")

    def check_supported(self) -> None:
        self.check_common()
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(
                400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens", code="invalid_value"
            )
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise OpenAIError(
                400,
                "best_of must equal n (pdserve returns every sequence it samples)",
                param="best_of",
                code="invalid_value",
            )

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each as text or token ids (a list of them: one choice each)."""
        prompt = self.prompt
        prompts: list[str | list[int]] = list(prompt) if _several_prompts(prompt) else [prompt]
        if len(prompts) * self.num_sequences > MAX_PROMPTS:
            raise OpenAIError(
                400,
                f"at most {MAX_PROMPTS} choices (prompts times n) per request",
                param="prompt",
                code="invalid_value",
            )
        return prompts


class TextPart(BaseModel):
    """The one kind of content part supported (images and audio are not)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[EarlierCall] | None = None  # an assistant's earlier calls (router/api/tools.py)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


MAX_MESSAGES = 8192  # per chat request: each costs validation and templating before anything can refuse it
MAX_TOOLS = 128  # OpenAI's limit on a request's tools


def _at_most(limit: int, what: str) -> BeforeValidator:
    """A list of at most ``limit`` items, counted before a single item is validated (pydantic's
    ``max_length`` counts after validating them all: 250 ms for 100,000 messages, on the event loop)."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} {what}, not {len(value)}")
        return value

    return BeforeValidator(check)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], _at_most(MAX_MESSAGES, "messages")] = Field(min_length=1)
    max_tokens: AtLeast1 | None = Field(default=None, json_schema_extra=NEW_TOKENS)
    max_completion_tokens: AtLeast1 | None = Field(default=None, json_schema_extra=NEW_TOKENS)
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    tools: Annotated[list[Any] | None, _at_most(MAX_TOOLS, "tools")] = None  # checked by router/api/tools.py
    tool_choice: Any = None
    add_generation_prompt: bool = True  # vLLM extension

    def check_supported(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(
                400, "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value"
            )

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [template_message(m) for m in self.messages]
