"""Router -> prefill/decode servers: JSON bodies of the internal control plane.

Validated strictly (unknown fields refused): both ends are pdserve, so a
mismatch is a bug to surface, not a client to tolerate. Every number is
finite and ranged (NaN, infinities and 2^63 are refused with 422), so
nothing a caller sends reaches the engine as a value it cannot hold. What a
request asks for is the engine's own ``SamplingParams``, bounds included.

``tenant`` is the name (never the key) of the router's tenant the request is
for (router/cluster/tenancy.py); the servers charge the blocks it computes to
that tenant's share of the shared KV store (engine/tiers/redis_shares.py). A
name that is not a tenant's name (length, characters) is refused with 422;
none is the default tenant.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.request import TENANT_NAME, SamplingParams, TokenId
from wire.names import INSTANCE_NAME
from wire.replies import Reservation

MAX_PROMPT = 1 << 22


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class GenerateRequest(Strict):
    """POST /generate on a decode (or colocated) server.

    ``local_prefill``: the server computes the prompt itself (colocated mode,
    or a prompt below the conditional-disaggregation threshold) instead of
    reserving blocks for a prefill server to fill.

    ``generated_token_ids``: the request continues a sequence that another
    decode server started (migration, router/cluster/session.py): the tokens
    it already produced after ``prompt_token_ids``, which the client has
    already received. They are computed here with the prompt and are never
    sent again; the next token is drawn as token ``len(generated_token_ids)``
    of the sequence (its seed, its grammar, ``min_tokens`` and ``max_tokens``
    count them). Only with ``local_prefill`` and one sequence (``sampling.n``
    1), and fewer than ``sampling.max_tokens``.
    """

    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT)
    sampling: SamplingParams  # the engine's own, with its bounds
    local_prefill: bool = False
    trace: str | None = Field(default=None, max_length=128)  # the router's W3C traceparent (tracing on)
    generated_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_PROMPT)
    tenant: str | None = Field(default=None, pattern=TENANT_NAME)  # who it is for: TENANT_NAME

    @model_validator(mode="after")
    def _continuation(self) -> GenerateRequest:
        if not self.generated_token_ids:
            return self
        if not self.local_prefill:
            raise ValueError("generated_token_ids needs local_prefill: a continued sequence is computed here")
        if self.sampling.n != 1:
            raise ValueError("generated_token_ids continues one sequence: sampling.n must be 1")
        if len(self.generated_token_ids) >= self.sampling.max_tokens:
            raise ValueError("generated_token_ids must be fewer than sampling.max_tokens")
        if len(self.prompt_token_ids) + len(self.generated_token_ids) > MAX_PROMPT:
            raise ValueError(f"prompt_token_ids and generated_token_ids hold more than {MAX_PROMPT} tokens together")
        return self


class PrefillRequest(Strict):
    """POST /prefill on a prefill server: compute this prompt into that reservation."""

    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT)
    sampling: SamplingParams  # the engine's own, with its bounds
    reservation: Reservation
    trace: str | None = Field(default=None, max_length=128)  # the router's W3C traceparent (tracing on)
    tenant: str | None = Field(default=None, pattern=TENANT_NAME)  # who it is for: TENANT_NAME


class AbortRequest(Strict):
    """POST /abort on either server: drop the request whatever its state."""

    request_id: str = Field(min_length=1, max_length=200)


class KVHello(Strict):
    """POST /kv/hello on a decode server, and its answer: a transfer handshake
    message (msgpack bytes made by ``transfer``), base64-encoded. A tensor-parallel decode
    server's answer: rank 0's in ``hello``, ranks 1..N-1's in ``ranks`` (each met the hello's
    sender)."""

    hello: str = Field(max_length=1 << 20)
    ranks: list[str] = Field(default_factory=list, max_length=64)


class KVPrefixRead(Strict):
    """POST /kv/read on a decode server, from a prefill server: every layer's K/V of tokens
    [start, end) of the cached prefix that reservation ``transfer_id`` pins (decode-to-prefill
    reuse, kvlink/prefix_read.py). Answered while the reservation waits for its KV, only."""

    transfer_id: str = Field(min_length=1, max_length=200)
    start: int = Field(ge=0)
    end: int = Field(gt=0)


class DecodePeer(Strict):
    """POST /admin/peers on a prefill server (from the router's discovery): a decode server
    that joined the cluster, which this prefill server may now hand KV to."""

    name: str = Field(pattern=INSTANCE_NAME)
    url: str = Field(min_length=8, max_length=300, pattern=r"^https?://[^/\s]+$")
