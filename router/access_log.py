"""The router's access log: one line per request, logged by ``pdserve.access``.

    access chatcmpl-1f3a… chat ok prompt=12 completion=8 ttft=45ms total=160ms prefill=p0 decode=d0
    access cmpl-77b2… completions 400 context_length_exceeded

A request that got as far as a dispatch session is logged when it ends (``RequestTimeline.close``):
its outcome (``ok``, the error code it ended with, or ``cancelled`` when the client left), its
tokens and times, and which prefill (``local`` when the decode server computed the prompt) and
decode servers served its last attempt. One refused before (a bad field, a prompt over the
context, no room) is logged with its HTTP status and code. On by default; ``router.access_log:
false`` turns it off.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

log = logging.getLogger("pdserve.access")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


class AccessLog:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._logged: OrderedDict[str, None] = OrderedDict()  # recent ids a timeline logged (event loop only)

    def served(
        self,
        request_id: str,
        endpoint: str,
        outcome: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        total: float,
        prefill: str | None,
        decode: str | None,
    ) -> None:
        if not self.enabled:
            return
        self._logged[request_id] = None
        while len(self._logged) > 4096:
            self._logged.popitem(last=False)
        log.info(
            "access %s %s %s prompt=%d completion=%d ttft=%s total=%s prefill=%s decode=%s",
            request_id,
            endpoint,
            outcome,
            prompt_tokens,
            completion_tokens,
            _ms(ttft),
            _ms(total),
            prefill or "-",
            decode or "-",
        )

    def refused(self, request_id: str, endpoint: str, status: int, code: str | None) -> None:
        """A request that ended with an error status; logged unless its timeline already said how it ended."""
        if not self.enabled:
            return
        if request_id in self._logged:
            del self._logged[request_id]
            return
        log.info("access %s %s %d %s", request_id, endpoint, status, code or "error")
