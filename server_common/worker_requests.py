"""Router -> prefill/decode servers: JSON bodies of the internal control plane.

Validated strictly (unknown fields refused): both ends are pdserve, so a
mismatch is a bug to surface, not a client to tolerate.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from server_common.worker_replies import Reservation


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingSpec(Strict):
    """The engine's SamplingParams, as JSON."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0 = off
    seed: int | None = None
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
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec
    local_prefill: bool = False
    trace: str | None = Field(default=None, max_length=128)  # the router's W3C traceparent (tracing on)


class PrefillRequest(Strict):
    """POST /prefill on a prefill server: compute this prompt into that reservation."""

    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[int] = Field(min_length=1)
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
