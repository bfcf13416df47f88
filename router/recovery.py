"""What the router does when a step of a request fails. Pure: no I/O.

Two kinds of failure (issue 6, DESIGN "Ownership of KV blocks"):

* **prefill failures**: the prefill server could not be reached or failed,
  or the decode server reported that the prompt's KV never arrived intact
  (lease expired, checksum mismatch, transfer failed). Before any token
  reached the client the request can start over, once: ``retry`` on another
  prefill server (on the decode server itself when there is none), ``local``
  on the decode server, or ``fail`` (recovery.prefill_failure in the config).
* **decode failures**: the decode server died or broke the stream. The
  client's request ends at once with a clear error; the prefill server is
  told to drop it.

A prefill server whose transfer the decode server ended (cancelled at lease
expiry, refused on a checksum mismatch) reports that with a code of its own;
the decode server tells the outcome on its stream (an error, or "reprefill":
it computes the prompt itself), so the router waits for that instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from router.settings import PrefillFailure

# Error codes on the decode stream meaning "the prompt's KV never arrived intact".
KV_NEVER_ARRIVED = frozenset({"lease_expired", "checksum_failed", "transfer_failed"})
# Prefill failure codes meaning "the decode server ended this transfer; its stream says how".
DECIDED_BY_DECODE = frozenset({"decode_refused", "decode_cancelled", "lease_expired"})
MAX_ATTEMPTS = 2  # the first try and one more
MODES = get_args(PrefillFailure)


class StepFailed(Exception):
    """One step of one attempt failed. ``stage`` is "prefill" or "decode"; ``worker`` its name."""

    def __init__(self, stage: str, worker: str, message: str, code: str) -> None:
        super().__init__(message)
        self.stage, self.worker, self.message, self.code = stage, worker, message, code


@dataclass(frozen=True)
class Decision:
    action: str  # "retry" (another prefill server) | "local" (prefill on the decode server) | "fail"
    why: str = ""  # for "fail": what to tell the client besides the failure itself


def decide(mode: PrefillFailure, failure: StepFailed, *, tokens_sent: bool, attempts: int,
           other_prefill: bool) -> Decision:
    """The next move after ``failure``; ``attempts`` made so far, ``other_prefill``: a healthy
    prefill server this request has not tried yet exists."""
    assert mode in MODES, mode
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
