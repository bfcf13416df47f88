"""Prefill/decode servers -> router: JSON replies and stream events.

The decode server's ``/generate`` answers with newline-delimited JSON, one
``DecodeEvent`` a line: first a ``reservation`` (``reservation`` is null when
the server prefills locally), then ``tokens`` events, the last one with a
``finish_reason``; or an ``error`` event that ends the stream. A ``reprefill``
event says the remote KV failed (lease, checksum) and the server computes the
prompt itself: the prefill server's part is over, tokens follow.

Every failure carries a ``transfer.outcome.Outcome`` code: the transfer
layer's own code where a transfer failed, passed on unchanged. A server
raises ``WorkerError`` and its route answers with ``ErrorReply`` (or an
``ErrorEvent`` on an open stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from engine.request import Logprob, StepOutput
from transfer.outcome import Outcome
from wire.kv_target import KVTarget
from wire.names import INSTANCE_NAME


class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


MAX_BLOCKS = 1 << 22  # a reservation's blocks, at most (a prompt's tokens are bounded the same)
BlockId = Annotated[int, Field(ge=0, lt=1 << 31)]
# The longest lease a reservation may carry, from now: a prefill server keeps a transfer open until
# its deadline, so a deadline of 1e308 would hold its work forever (configs use 10-30 s).
MAX_LEASE_S = 3600.0


class Reservation(Reply):
    """Blocks a decode server holds for one request until its KV arrives.

    ``kv_target`` says where to write (``wire.kv_target.KVTarget``: the decode
    server's transfer agent and epoch, and its tensor-parallel ranks if it has
    several; ``transfer_id`` is then rank 0's, the group's id). The router
    passes it on as it came.
    ``lease_s`` is how long the decode server still waits for the KV,
    counted from when the reservation is sent: then it frees the blocks and
    fails the request. Whoever holds the reservation before passing it on
    (the router, the prefill server before it writes) takes the time it
    held it off, so no two hosts need to share a clock. The first ``num_cached_tokens`` prompt
    tokens are already in ``block_ids`` (the decode server's cached prefix,
    pinned for this request): the prefill server writes only the tokens
    ``[num_cached_tokens, num_tokens)``.
    """

    instance: str = Field(pattern=INSTANCE_NAME)
    request_id: str = Field(min_length=1, max_length=200)
    transfer_id: str = Field(min_length=1, max_length=200)
    block_ids: list[BlockId] = Field(min_length=1, max_length=MAX_BLOCKS)
    block_size: int = Field(ge=1, le=256)  # engine/config.py's range
    num_tokens: int = Field(ge=1, le=MAX_BLOCKS)
    lease_s: float = Field(gt=0, le=MAX_LEASE_S)  # finite
    kv_target: KVTarget
    num_cached_tokens: int = Field(default=0, ge=0)
    # the decode server's role epoch when it reserved (deploy/role_server.py); the prefill server's
    # handshake carries it and a server in another epoch refuses it. None: a server that reports none.
    role_epoch: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _fits(self) -> Reservation:
        if len(self.block_ids) * self.block_size < self.num_tokens:
            raise ValueError(f"{len(self.block_ids)} blocks of {self.block_size} cannot hold {self.num_tokens} tokens")
        if self.num_cached_tokens > self.num_tokens:
            raise ValueError(f"num_cached_tokens {self.num_cached_tokens} exceeds num_tokens {self.num_tokens}")
        return self


class ReservationEvent(Reply):
    """``num_cached_tokens``: prompt tokens the decode server found in its prefix cache (either path)."""

    type: Literal["reservation"] = "reservation"
    reservation: Reservation | None
    num_cached_tokens: int = Field(default=0, ge=0)


class TokenLogprob(Reply):
    """engine.request.Logprob: a token's log-probability and the top (token id, log-probability)
    pairs of its distribution, most likely first."""

    logprob: float
    top: list[tuple[int, float]] = []


class TokensEvent(Reply):
    """Tokens of sequence ``index`` (0 .. n-1); each sequence's last event has a finish_reason,
    and the stream ends after every sequence's ("grammar": the request's grammar could not go on,
    the client's fault: engine/scheduler.py ``_record``). ``logprobs``: one per token id, when asked for.
    ``prompt_logprobs``: on the first event of sequence 0 when this server computed the prompt
    (a remote prefill's come in ``PrefillResult``): one per prompt token, None for the first."""

    type: Literal["tokens"] = "tokens"
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "abort", "grammar"] | None = None
    index: int = Field(default=0, ge=0)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def token_logprobs(logprobs: Sequence[Logprob] | None) -> list[TokenLogprob] | None:
    """``StepOutput.logprobs`` as sent."""
    if logprobs is None:
        return None
    return [TokenLogprob(logprob=lp.logprob, top=list(lp.top)) for lp in logprobs]


def prompt_token_logprobs(logprobs: Sequence[Logprob | None] | None) -> list[TokenLogprob | None] | None:
    """``StepOutput.prompt_logprobs`` as sent: None for the first prompt token."""
    if logprobs is None:
        return None
    return [None if lp is None else TokenLogprob(logprob=lp.logprob, top=list(lp.top)) for lp in logprobs]


def tokens_event(out: StepOutput) -> TokensEvent:
    """An ``engine.request.StepOutput`` of a decode or colocated server as its stream event."""
    reason = out.finish_reason if out.finished else None
    if reason == "prefilled":
        raise ValueError("a prefill server's output is not a stream event")
    return TokensEvent(
        index=out.index,
        token_ids=out.new_token_ids,
        finish_reason=reason,
        logprobs=token_logprobs(out.logprobs),
        prompt_logprobs=prompt_token_logprobs(out.prompt_logprobs),
    )


class ErrorEvent(Reply):
    type: Literal["error"] = "error"
    message: str
    code: Outcome


class ReprefillEvent(Reply):
    type: Literal["reprefill"] = "reprefill"
    message: str
    code: Outcome  # why the remote KV was given up (lease_expired, checksum_mismatch)


# A decode server with nothing else to send on a stream sends this every STREAM_HEARTBEAT_S, from its
# event loop: a stream silent for longer than the router's stream_stall_s is a server that stopped.
STREAM_HEARTBEAT_S = 1.0


class AliveEvent(Reply):
    type: Literal["alive"] = "alive"


DecodeEvent = Annotated[
    ReservationEvent | TokensEvent | ErrorEvent | ReprefillEvent | AliveEvent, Field(discriminator="type")
]
DECODE_EVENT: TypeAdapter[DecodeEvent] = TypeAdapter(DecodeEvent)


class PrefillResult(Reply):
    """Reply to POST /prefill once the KV is written and the notice sent. ``first_token_ids``:
    the first token of each sequence (``sampling.n``); ``first_logprobs``: theirs, when the
    request asked for logprobs (the decode server's stream has none for them)."""

    request_id: str
    first_token_ids: list[int]
    num_tokens: int
    transfer_bytes: int
    seconds: float
    first_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for: one per prompt token, None first


class KVBlocks(Reply):
    free: int
    reserved: int
    running: int
    total: int = 0  # free + reserved + running when nothing leaks
    block_size: int = 0  # tokens a block holds (0: not reported): total x block_size is what the cache can hold


class HealthReport(Reply):
    """GET /health on either server."""

    status: Literal["ok", "draining"] = "ok"  # draining: alive, finishing its requests, taking no new ones
    role: Literal["prefill", "decode", "colocated"]
    instance: str
    kv_blocks: KVBlocks
    queue_depth: int
    queued_tokens: int
    num_requests: int
    launch_id: str | None = None  # the nonce of the `pdserve launch` that started it (None: started alone)
    model: str = ""  # server_common.model_id.model_fingerprint of the folder it serves
    role_epoch: int = 0  # bumped by each role switch in place (deploy/role_server.py)


class KvEventsReply(Reply):
    """GET /kv/events?after=SEQ: the block hashes stored and evicted since SEQ (engine/kv_events.py).

    ``oldest`` past SEQ + 1 means events were lost; a new ``epoch`` means a new process:
    either way the reader takes GET /kv/blocks. ``salt`` and ``block_size`` are what the
    reader needs to hash a prompt as this server does (engine/prefix_cache.py, ``chain_hashes``)."""

    epoch: str
    oldest: int
    last: int
    events: list[tuple[int, Literal["stored", "evicted", "tiered", "untiered"], int]]
    block_size: int
    salt: str
    enabled: bool  # prefix caching on


class KvBlocksReply(Reply):
    """GET /kv/blocks: every block hash held now, current as of event ``seq``; ``tiered``: those the
    server's own lower tiers (host memory, disk) hold, which it loads instead of computing."""

    epoch: str
    seq: int
    hashes: list[int]
    tiered: list[int] = Field(default_factory=list)
    block_size: int
    salt: str
    enabled: bool


class ErrorReply(Reply):
    """Body of a 4xx/5xx from a server (503 with a Retry-After header)."""

    error: str
    code: Outcome


class WorkerError(Exception):
    """A server could not do what it was asked; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, code: Outcome, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after

    def reply(self) -> ErrorReply:
        return ErrorReply(error=self.message, code=self.code)
