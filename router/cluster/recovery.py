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
* **decode failures**: the decode server died or broke the stream. The
  client's request ends at once with a clear error; the prefill server is
  told to drop it.

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

MAX_ATTEMPTS = 2  # the first try and one more


@dataclass(frozen=True)
class Decision:
    action: str  # "retry" (another prefill server) | "local" (prefill on the decode server) | "fail"
    why: str = ""  # for "fail": what to tell the client besides the failure itself


def decide(
    mode: PrefillFailure, failure: WorkerFailed, *, tokens_sent: bool, attempts: int, other_prefill: bool
) -> Decision:
    """The next move after ``failure``; ``attempts`` made so far, ``other_prefill``: a healthy
    prefill server this request has not tried yet exists."""
    if failure.stage == "decode":
        return Decision("fail")
    if tokens_sent:
        return Decision("fail", "tokens were already sent")
    if mode == "fail":
        return Decision("fail")
    if attempts >= MAX_ATTEMPTS:
        return Decision("fail", f"gave up after {attempts} attempts")
    if mode == "retry" and other_prefill:
        return Decision("retry")
    return Decision("local")
