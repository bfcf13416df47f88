"""One request's timeline at the router: latency histograms and, when tracing
is on, its spans (server_common/tracing.py).

TTFT and end-to-end latency count from the request's arrival at the router,
so they include the wait for admission; inter-token latency is the gap
between two generated tokens (tokens that arrive together share it); time
per output token is (last token - first token) / (tokens - 1) per request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from router.access_log import AccessLog
from router.metrics import RouterMetrics
from server_common.timeline_log import TimelineLog
from server_common.tracing import Tracing

if TYPE_CHECKING:
    from router.cluster.session import Session


class RequestTimeline:
    def __init__(
        self,
        metrics: RouterMetrics,
        tracing: Tracing,
        log: TimelineLog,
        request_id: str,
        client_traceparent: str | None = None,
        access: AccessLog | None = None,
        endpoint: str = "",
    ) -> None:
        self._metrics = metrics
        self._access, self._endpoint = access, endpoint
        self._prompt_tokens = 0
        self._max_tokens = 0  # the most it may generate, all choices together
        self._tracing = tracing
        self._log = log
        self._request_id = request_id
        self.arrived = time.monotonic()
        self._opened: float | None = None
        self._first: float | None = None  # the first and the last token's arrival: set together
        self._last: float | None = None
        self._outcome: str | None = None
        self._closed = False
        self._span = tracing.start(
            "pdserve.request", tracing.parent(client_traceparent), self.arrived, pdserve__request_id=request_id
        )

    @property
    def traceparent(self) -> str | None:
        """What the decode and prefill servers get, so that their spans nest under this request."""
        return self._tracing.traceparent(self._span)

    def came_in(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """The request came in (before the waiting room): ``max_tokens`` for all its choices together."""
        self._max_tokens = max_tokens
        m = self._metrics
        m.arrived_requests.inc()
        m.arrived_prompt_tokens.inc(num_prompt_tokens)
        m.arrived_max_tokens.inc(max_tokens)

    def opened(self, num_prompt_tokens: int, local_prefill: bool) -> None:
        """The decode stream is open: admission and the reservation are done."""
        self._opened = time.monotonic()
        self._prompt_tokens = num_prompt_tokens
        self._metrics.prompt_tokens.inc(num_prompt_tokens)
        self._metrics.prompt_tokens_per_request.observe(num_prompt_tokens)
        if local_prefill:
            self._metrics.local_prefills.inc()
        self._tracing.record(
            "router.admission", self._span, self.arrived, self._opened, pdserve__local_prefill=local_prefill
        )

    def tokens(self, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        if self._last is None:
            self._first = now
            self._metrics.ttft.observe(now - self.arrived)
        else:
            gap = (now - self._last) / n
            for _ in range(n):
                self._metrics.itl.observe(gap)
        self._last = now

    def finished(self, reason: str, num_tokens: int) -> None:
        m = self._metrics
        m.e2e.observe(time.monotonic() - self.arrived)
        m.completion_tokens.inc(num_tokens)
        m.finished_max_tokens.inc(self._max_tokens)
        m.generation_tokens_per_request.observe(num_tokens)
        m.finished.labels(finish_reason=reason).inc()
        if num_tokens > 1 and self._first is not None and self._last is not None:
            m.tpot.observe((self._last - self._first) / (num_tokens - 1))
        self._outcome = "ok"

    def failed(self, code: str | None) -> None:
        self._outcome = str(code or "error")

    def close(self, session: Session | None = None, num_tokens: int = 0) -> None:
        """End the request's spans (idempotent): a request neither finished nor failed was cancelled."""
        if self._closed:
            return
        self._closed = True
        if self._access is not None:
            prefill = None if session is None else "local" if session.prefill is None else session.prefill.name
            self._access.served(
                self._request_id,
                self._endpoint,
                self._outcome or "cancelled",
                self._prompt_tokens,
                num_tokens,
                None if self._first is None else self._first - self.arrived,
                time.monotonic() - self.arrived,
                prefill,
                session.decode.name if session is not None else None,
            )
        self._log.add(
            self._request_id, arrived=self.arrived, opened=self._opened, first_token=self._first, last_token=self._last
        )
        if self._first is not None and self._last is not None:
            self._tracing.record("router.stream", self._span, self._first, self._last, pdserve__tokens=num_tokens)
        attributes: dict[str, Any] = {}  # the span's
        if session is not None:
            attributes = {
                "pdserve__decode": session.decode.name,
                "pdserve__prefill": session.prefill.name if session.prefill else None,
                "pdserve__attempts": session.attempt_id,
            }
        self._tracing.end(
            self._span, outcome=self._outcome or "cancelled", pdserve__generated_tokens=num_tokens, **attributes
        )
