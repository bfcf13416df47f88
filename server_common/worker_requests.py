"""Router -> prefill/decode servers: JSON bodies of the internal control plane.

Validated strictly (unknown fields refused): both ends are pdserve, so a
mismatch is a bug to surface, not a client to tolerate. Every number is
finite and ranged (NaN, infinities and 2^63 are refused with 422), so
nothing a caller sends reaches the engine as a value it cannot hold.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from server_common.worker_replies import Reservation
from server_common.process_defaults import INSTANCE_NAME


MAX_TOKENS = 1 << 24  # far above any context a pdserve engine holds
MAX_PROMPT = 1 << 22
MAX_N = 16  # sequences per request
MAX_LOGPROBS = 20  # engine.request.MAX_LOGPROBS
MAX_STOP_TOKEN_IDS = 1024
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class StructuredSpec(Strict):
    """engine.request.StructuredSpec: a grammar the output must match, checked by the router."""

    kind: Literal["json_schema", "regex", "choice", "lark"]
    value: str = Field(max_length=1 << 20)


class SamplingSpec(Strict):
    """The engine's SamplingParams, as JSON."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1 << 24)  # 0 = off
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    logit_bias: tuple[tuple[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]], ...] = Field(
        default=(), max_length=1 << 16)
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    stop_token_ids: tuple[TokenId, ...] = Field(default=(), max_length=MAX_STOP_TOKEN_IDS)
    structured: StructuredSpec | None = None

    def engine_params(self):
        """The engine's ``SamplingParams`` (servers only: imported here, so the router,
        which never calls this, does not import the engine and torch)."""
        from engine import SamplingParams
        from engine.request import StructuredSpec as EngineStructured

        structured = None if self.structured is None else EngineStructured(self.structured.kind,
                                                                           self.structured.value)
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, ignore_eos=self.ignore_eos, n=self.n,
                              logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                              min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
                              structured=structured)


class GenerateRequest(Strict):
    """POST /generate on a decode (or colocated) server.

    ``local_prefill``: the server computes the prompt itself (colocated mode,
    or a prompt below the conditional-disaggregation threshold) instead of
    reserving blocks for a prefill server to fill.
    """

    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT)
    sampling: SamplingSpec
    local_prefill: bool = False
    trace: str | None = Field(default=None, max_length=128)  # the router's W3C traceparent (tracing on)


class PrefillRequest(Strict):
    """POST /prefill on a prefill server: compute this prompt into that reservation."""

    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT)
    sampling: SamplingSpec
    reservation: Reservation
    trace: str | None = Field(default=None, max_length=128)  # the router's W3C traceparent (tracing on)


class AbortRequest(Strict):
    """POST /abort on either server: drop the request whatever its state."""

    request_id: str = Field(min_length=1, max_length=200)


class KVHello(Strict):
    """POST /kv/hello on a decode server, and its answer: a transfer handshake
    message (msgpack bytes made by ``transfer``), base64-encoded."""

    hello: str = Field(max_length=1 << 20)


class DecodePeer(Strict):
    """POST /admin/peers on a prefill server (from the router's discovery): a decode server
    that joined the cluster, which this prefill server may now hand KV to."""

    name: str = Field(pattern=INSTANCE_NAME)
    url: str = Field(min_length=8, max_length=300, pattern=r"^https?://[^/\s]+$")
