"""Router -> prefill/decode servers: JSON bodies of the internal control plane.

Validated strictly (unknown fields refused): both ends are pdserve, so a
mismatch is a bug to surface, not a client to tolerate. Every number is
finite and ranged (NaN, infinities and 2^63 are refused with 422), so
nothing a caller sends reaches the engine as a value it cannot hold.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from server_common.worker_replies import Reservation


MAX_TOKENS = 1 << 24  # far above any context a pdserve engine holds
MAX_PROMPT = 1 << 22
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SamplingSpec(Strict):
    """The engine's SamplingParams, as JSON."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1 << 24)  # 0 = off
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    ignore_eos: bool = False

    def engine_params(self):
        """The engine's ``SamplingParams`` (servers only: imported here, so the router,
        which never calls this, does not import the engine and torch)."""
        from engine import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, ignore_eos=self.ignore_eos)


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

    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.-]+$")
    url: str = Field(min_length=8, max_length=300, pattern=r"^https?://[^/\s]+$")
