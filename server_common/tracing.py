"""Optional OpenTelemetry traces: one trace per request across router, decode and prefill.

Off by default (``tracing:`` in the cluster YAML names an OTLP/HTTP endpoint
to turn it on). Off costs nothing: ``Tracing`` then never imports
opentelemetry, every method returns at once and no context is passed on.

The W3C ``traceparent`` of a client request is honoured; the router starts a
``pdserve.request`` span under it and passes its own traceparent to the
decode and prefill servers in the internal request bodies (``trace`` of
``GenerateRequest`` / ``PrefillRequest``), so their spans nest under the
router's. Stages that run on other threads (queue, compute, the KV transfer)
are recorded as timestamps and turned into spans once the request's part on
that server ended, with explicit start and end times: the engine and
transfer threads never touch a tracer.

Span names (attributes in ``docs/architecture.md``, "Traces")::

    pdserve.request                 router: arrival to the last token (or the error)
      router.admission              router: arrival to the decode stream opened (reservation in)
      router.stream                 router: first token to last token
      decode.generate               decode server: /generate opened to closed
        decode.kv_wait              reservation to KV verified (or its failure, with the outcome code)
        decode.decode               first token to the last
      prefill.prefill               prefill server: /prefill received to answered
        prefill.queue               received to its first chunk computed
        prefill.compute             first chunk to first token sampled
        prefill.kv_transfer         first layer pushed to the decode server's ack (outcome code)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
TRACEPARENT = "traceparent"


@dataclass(frozen=True)
class TracingSettings:
    endpoint: str | None = None  # OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces; None: off
    sample_ratio: float = 1.0  # share of new traces recorded (a client's sampled flag is honoured)
    export_delay_s: float = 0.5  # how long finished spans wait to be sent in a batch


class Tracing:
    """A process's tracer, or nothing when tracing is off.

    ``exporter`` (tests): an OpenTelemetry span exporter used instead of OTLP,
    with spans exported as they end."""

    def __init__(self, settings: TracingSettings, service_name: str, exporter: Any = None) -> None:
        self.enabled = settings.endpoint is not None or exporter is not None
        # One offset from time.monotonic() to Unix time, so stamps taken on any thread line up exactly.
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._tracer = None
        self._provider = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        self._provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        if exporter is not None:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self._provider.add_span_processor(
                BatchSpanProcessor(
                    OTLPSpanExporter(endpoint=settings.endpoint),
                    schedule_delay_millis=int(settings.export_delay_s * 1000),
                )
            )
        self._tracer = self._provider.get_tracer("pdserve")

    # ---- contexts --------------------------------------------------------------
    def parent(self, traceparent: str | None):
        """The context a W3C traceparent names (None: a new trace)."""
        if not self.enabled or not traceparent:
            return None
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})

    def traceparent(self, span) -> str | None:
        """What to pass on so the other side's spans nest under ``span``."""
        if span is None:
            return None
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
        return carrier.get(TRACEPARENT)

    # ---- spans -----------------------------------------------------------------
    def start(self, name: str, parent=None, start: float | None = None, **attributes):
        """A live span (end it with ``end``); ``parent``: a context or a span; ``start``: monotonic s."""
        if not self.enabled:
            return None
        return self._tracer.start_span(
            name,
            context=self._context(parent),
            attributes=_clean(attributes),
            start_time=None if start is None else self._wall_ns(start),
        )

    def end(self, span, end: float | None = None, outcome: str | None = None, **attributes) -> None:
        """End ``span`` (``end``: monotonic s); an outcome other than ok marks it failed."""
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attributes(_clean(attributes))
        if outcome is not None:
            span.set_attribute("pdserve.outcome", str(outcome))
            if outcome != "ok":
                span.set_status(Status(StatusCode.ERROR, str(outcome)))
        span.end(end_time=None if end is None else self._wall_ns(end))

    def record(self, name: str, parent, start: float, end: float, outcome: str | None = None, **attributes):
        """A span that already happened, from monotonic timestamps; returns it (ended)."""
        span = self.start(name, parent, start, **attributes)
        self.end(span, end, outcome)
        return span

    def _wall_ns(self, monotonic_s: float) -> int:
        return self._offset_ns + int(monotonic_s * 1e9)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()

    def _context(self, parent):
        if parent is None:
            return None
        from opentelemetry import trace
        from opentelemetry.context import Context

        return parent if isinstance(parent, Context) else trace.set_span_in_context(parent)


def _clean(attributes: dict) -> dict:
    return {k.replace("__", "."): v for k, v in attributes.items() if v is not None}
