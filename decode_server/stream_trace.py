"""The spans of one ``/generate`` stream, from what the event loop sees
(server_common/tracing.py): the reservation's wait for its KV ends with the
first token, a reprefill or an error event; decoding runs from the first
token to the last."""

from __future__ import annotations

import time

from server_common.timeline_log import TimelineLog
from server_common.tracing import Tracing
from transfer.outcome import Outcome
from wire.replies import DecodeEvent, ErrorEvent, ReprefillEvent, TokensEvent


class StreamTrace:
    """Also adds the stream's stages to the server's ``TimelineLog`` when it closes."""

    def __init__(
        self, tracing: Tracing, log: TimelineLog, traceparent: str | None, request_id: str, remote: bool, instance: str
    ) -> None:
        self._tracing = tracing
        self._log = log
        self._request_id: str | None = request_id
        self._remote = remote
        self._kv_at: float | None = None
        self._started = time.monotonic()
        self._first: float | None = None
        self._last: float | None = None
        self._tokens = 0
        self._outcome: str | None = None
        self._span = tracing.start(
            "decode.generate",
            tracing.parent(traceparent),
            self._started,
            pdserve__request_id=request_id,
            pdserve__instance=instance,
            pdserve__remote_prefill=remote,
        )

    def prefilled_here(self) -> None:
        """No KV will arrive: this server computes the prompt (all but its last token may be cached)."""
        self._remote = False

    def event(self, event: DecodeEvent) -> None:
        if self._request_id is None:
            return  # closed
        now = time.monotonic()
        if isinstance(event, (ErrorEvent, ReprefillEvent)):
            self._kv_waited(now, event.code)
            if isinstance(event, ErrorEvent):
                self._outcome = event.code
        elif isinstance(event, TokensEvent) and event.token_ids:
            if self._first is None:
                self._first = now
                self._kv_waited(now, Outcome.OK)
            self._last = now
            self._tokens += len(event.token_ids)
            if event.finish_reason is not None:
                self._outcome = Outcome.OK

    def _kv_waited(self, now: float, outcome: str) -> None:
        if self._remote:
            self._kv_at = now
            self._tracing.record("decode.kv_wait", self._span, self._started, now, outcome)
            self._remote = False  # recorded once: what follows a reprefill is local

    def close(self, outcome: str | None = None) -> None:
        """End the spans (idempotent); ``outcome``: why it ended, when no event said so."""
        if self._request_id is None:
            return
        self._log.add(
            self._request_id,
            reserved=self._started,
            kv_arrived=self._kv_at,
            first_token=self._first,
            last_token=self._last,
        )
        self._request_id = None
        if self._first is not None and self._last is not None:
            self._tracing.record("decode.decode", self._span, self._first, self._last, pdserve__tokens=self._tokens)
        self._tracing.end(
            self._span, outcome=self._outcome or outcome or Outcome.CANCELLED, pdserve__tokens=self._tokens
        )
