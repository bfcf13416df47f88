"""How a transfer, a server's step or a request attempt ends: one vocabulary.

The transfer layer reports these codes, the prefill and decode servers put
them in their replies and stream events unchanged, and the router's recovery
rules (``router/cluster/recovery.py``) decide on them. Nobody renames a code on the
way up and nobody reads an error message to learn what happened: the message
is for people, the code is for code. The enumeration lives here because the
transfer layer is the lowest package that reports outcomes; this module
imports nothing, so the router takes it without torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


class Outcome(StrEnum):
    OK = "ok"

    # -- the transfer layer, receiver (decode) side
    LEASE_EXPIRED = "lease_expired"  # no verified KV within the reservation's lease
    CANCELLED = "cancelled"  # the receiver stopped waiting (client left, request aborted)
    CHECKSUM_MISMATCH = "checksum_mismatch"  # the KV in the blocks is not what the sender computed
    BAD_NOTICE = "bad_notice"  # a completion notice that does not fit the reservation
    OUT_OF_BOUNDS = "out_of_bounds"  # a write outside the reserved blocks

    # -- the transfer layer, sender (prefill) side
    ABORTED = "aborted"  # the request was dropped here (router abort, client left)
    REFUSED = "refused"  # the receiver answered the notice with "not accepted"
    PEER_LOST = "peer_lost"  # the transport saw the decode server go away
    NO_ACK = "no_ack"  # the notice was sent, no answer came within the grace period
    TRANSPORT = "transport"  # a write or notice could not be posted

    # -- the servers
    NO_ROOM = "no_room"  # not enough free KV blocks for the reservation
    DRAINING = "draining"  # the server finishes its requests and takes no new ones
    ENGINE_DOWN = "engine_down"  # the engine thread is not running
    DUPLICATE_REQUEST = "duplicate_request"  # a request with this id is already active
    BAD_REQUEST = "bad_request"  # the engine refused the request's values
    HANDSHAKE_FAILED = "handshake_failed"  # the prefill server could not meet the decode server
    INCOMPATIBLE_PEER = "incompatible_peer"  # the other server runs another model, layout or backend
    PEER_BOUND = "peer_bound"  # a peer name is held by another live instance, or fixed by the config
    UNAUTHORIZED = "unauthorized"  # an internal call without the cluster's internal secret
    TOO_LARGE = "request_too_large"  # a request body over the server's cap
    WRONG_ROLE = "wrong_role"  # a call for a role the instance no longer has (it switched: deploy/role_server.py)
    STALE_EPOCH = "stale_epoch"  # a call addressed to an earlier role epoch of the instance
    SWITCHING = "switch_in_progress"  # the instance is changing role; or a switch asked while one runs
    # a reservation made in a role epoch its decode server has left (the handshake was refused)
    STALE_RESERVATION = "stale_reservation"
    # a decode server's cached prefix not read: computing it was estimated faster (prefill_server/pull_rule.py)
    NOT_WORTH_IT = "not_worth_it"

    # -- the router's view of a worker
    UNREACHABLE = "unreachable"  # connection refused or reset
    # no answer in time (a busy worker, or a hung one; router/cluster/health.py tells them apart)
    TIMED_OUT = "timed_out"
    STREAM_CUT = "stream_cut"  # the decode stream ended before its last token
    WORKER_ERROR = "worker_error"  # an answer the router cannot read
    NO_PREFILL = "no_prefill"  # no prefill server in rotation that this request has not tried


class PeerBound(RuntimeError):
    """A hello names a prefill server that is bound to another instance, still connected."""


# Decode-stream outcomes meaning "the prompt's KV never arrived intact": the
# prefill stage failed, even though the decode server reported it.
KV_NEVER_ARRIVED = frozenset(
    {Outcome.LEASE_EXPIRED, Outcome.CHECKSUM_MISMATCH, Outcome.BAD_NOTICE, Outcome.OUT_OF_BOUNDS}
)

# Prefill outcomes meaning "the decode server ended this transfer": it says on
# its own stream what happens next (an error, or it prefills the prompt itself).
DECIDED_BY_DECODE = frozenset({Outcome.REFUSED, Outcome.CANCELLED, Outcome.LEASE_EXPIRED, Outcome.STALE_RESERVATION})


@dataclass(frozen=True)
class TransferEnded:
    """One transfer ended: ``outcome`` is ``Outcome.OK`` or why it failed
    (``reason`` is for people). ``first_tokens``: on the receiver side of a
    completed transfer, the tokens the prefill server sampled (one per sequence). ``at``: when
    the transfer thread saw it end (``time.monotonic()``)."""

    transfer_id: str
    outcome: Outcome
    reason: str = ""
    first_tokens: tuple[int, ...] | None = None
    at: float = field(default_factory=time.monotonic)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK
