"""What the router does when a step of a request fails. Pure: no I/O.

Two kinds of failure (``WorkerFailed.stage``; see docs/architecture.md,
"Ownership of KV blocks"):

* **prefill failures**: the prefill server could not be reached or failed,
  or the decode server reported that the prompt's KV never arrived intact
  (``transfer.outcome.KV_NEVER_ARRIVED``: lease expired, checksum mismatch,
  a bad notice or write). Before any token reached the client the request
  can start over, once: ``retry`` on another prefill server (on the decode
  server itself when there is none), ``local`` on the decode server, or
  ``fail`` (recovery.prefill_failure in the config).
* **decode failures**: the decode server died, broke or cut the stream,
  stopped sending (``stream_stall_s``), said its engine is down, or moves
  its streams off as it drains (``MIGRATES``). The request is migrated to
  another decode server (router/cluster/session.py), at most
  ``migration_limit`` times (recovery.migration_limit in the config); past
  that, or on any other decode failure, the client gets a clear error and
  the prefill server is told to drop the request.

A prefill server whose transfer the decode server ended (cancelled at lease
expiry, refused on a checksum mismatch) reports the transfer layer's outcome
(``transfer.outcome.DECIDED_BY_DECODE``); the decode server tells what
happens next on its stream (an error, or "reprefill": it computes the prompt
itself), so the router waits for that instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.cluster.worker_client import WorkerFailed
from router.settings import PrefillFailure
from transfer.outcome import Outcome

MAX_ATTEMPTS = 2  # the first try and one more

# Decode failures that say the server (not the request) is the problem: the request moves on.
MIGRATES = frozenset(
    {
        Outcome.UNREACHABLE,
        Outcome.TIMED_OUT,
        Outcome.STREAM_CUT,
        Outcome.WORKER_ERROR,
        Outcome.ENGINE_DOWN,
        Outcome.DRAINING,
        Outcome.WRONG_ROLE,
        Outcome.STALE_EPOCH,
    }
)


@dataclass(frozen=True)
class Decision:
    # "retry" (another prefill server) | "local" (prefill on the decode server) | "migrate" (another
    # decode server continues it) | "fail"
    action: str
    why: str = ""  # for "fail": what to tell the client besides the failure itself


def decide(
    mode: PrefillFailure,
    failure: WorkerFailed,
    *,
    tokens_sent: bool,
    attempts: int,
    other_prefill: bool,
    migrations: int = 0,
    migration_limit: int = 0,
) -> Decision:
    """The next move after ``failure``; ``attempts`` made so far, ``other_prefill``: a healthy
    prefill server this request has not tried yet exists; ``migrations`` made so far, of at
    most ``migration_limit``."""
    if failure.stage == "decode":
        if failure.outcome not in MIGRATES:
            return Decision("fail")
        if migrations >= migration_limit:
            return Decision("fail", f"recovery.migration_limit ({migration_limit}) reached")
        return Decision("migrate")
    if tokens_sent:
        return Decision("fail", "tokens were already sent")
    if mode == "fail":
        return Decision("fail")
    if attempts >= MAX_ATTEMPTS:
        return Decision("fail", f"gave up after {attempts} attempts")
    if mode == "retry" and other_prefill:
        return Decision("retry")
    return Decision("local")
