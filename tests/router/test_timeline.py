"""router/timeline.py: one request's latency histograms, access-log line, timeline entry and spans
at the router. The module's clock is replaced by one the test moves, so every latency is exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import router.timeline
from router.access_log import AccessLog
from router.cluster.registry import Worker, WorkerRegistry
from router.metrics import RouterMetrics
from router.timeline import RequestTimeline
from server_common.timeline_log import TimelineLog
from server_common.tracing import Tracing, TracingSettings

CLIENT_TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


class Served(AccessLog):
    """The access log's lines as argument tuples."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple] = []

    def served(self, *args) -> None:
        self.lines.append(args)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock(100.0)
    monkeypatch.setattr(router.timeline, "time", clock)
    return clock


def metrics() -> RouterMetrics:
    return RouterMetrics(WorkerRegistry([]))


def sample(m: RouterMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def session(prefill: str | None, decode: str = "d0", attempt: str = "r1") -> SimpleNamespace:
    return SimpleNamespace(
        prefill=None if prefill is None else Worker(prefill, "prefill", "u"),
        decode=Worker(decode, "decode", "u"),
        attempt_id=attempt,
    )


def test_latencies_count_from_arrival_and_tokens_arriving_together_share_their_gap(clock):
    m, access, log = metrics(), Served(), TimelineLog()
    timeline = RequestTimeline(m, Tracing(TracingSettings(), "router"), log, "r1", access=access, endpoint="chat")
    clock.now = 100.5
    timeline.opened(3, local_prefill=False)
    clock.now = 101.0
    timeline.tokens(1)  # TTFT 1.0
    timeline.tokens(0)  # nothing arrived: nothing counted
    clock.now = 102.0
    timeline.tokens(2)  # two tokens at once: two gaps of 0.5
    clock.now = 103.0
    timeline.finished("stop", 3)
    timeline.close(session("p0"), num_tokens=3)

    hist = "pdserve_router_{}_seconds"
    assert sample(m, hist.format("time_to_first_token") + "_sum") == 1.0
    assert sample(m, hist.format("inter_token_latency") + "_count") == 2.0
    assert sample(m, hist.format("inter_token_latency") + "_sum") == 1.0
    assert sample(m, hist.format("time_per_output_token") + "_sum") == 0.5  # (102 - 101) / (3 - 1)
    assert sample(m, hist.format("e2e_request_latency") + "_sum") == 3.0
    assert sample(m, "pdserve_router_prompt_tokens_total") == 3.0
    assert sample(m, "pdserve_router_completion_tokens_total") == 3.0
    assert sample(m, "pdserve_router_finished_requests_total", finish_reason="stop") == 1.0
    assert sample(m, "pdserve_router_local_prefills_total") == 0.0
    assert access.lines == [("r1", "chat", "ok", 3, 3, 1.0, 3.0, "p0", "d0")]
    [entry] = log.entries()
    assert entry["request_id"] == "r1"
    assert sorted(entry) == ["arrived", "first_token", "last_token", "opened", "request_id"]
    assert entry["last_token"] - entry["first_token"] == pytest.approx(1.0)


def test_a_request_with_one_token_has_no_time_per_output_token_and_a_local_prefill_is_counted(clock):
    m, access = metrics(), Served()
    timeline = RequestTimeline(m, Tracing(TracingSettings(), "router"), TimelineLog(), "r1", access=access)
    timeline.opened(4, local_prefill=True)
    clock.now = 100.25
    timeline.tokens(1)
    timeline.finished("length", 1)
    timeline.close(session(None), num_tokens=1)
    assert sample(m, "pdserve_router_time_per_output_token_seconds_count") == 0.0
    assert sample(m, "pdserve_router_local_prefills_total") == 1.0
    assert access.lines == [("r1", "", "ok", 4, 1, 0.25, 0.25, "local", "d0")]


def test_a_request_is_counted_as_it_arrives_and_its_max_tokens_again_as_it_finishes(clock):
    m = metrics()
    timeline = RequestTimeline(m, Tracing(TracingSettings(), "router"), TimelineLog(), "r1")
    timeline.came_in(7, max_tokens=20)
    assert sample(m, "pdserve_router_arrived_requests_total") == 1.0
    assert sample(m, "pdserve_router_arrived_prompt_tokens_total") == 7.0
    assert sample(m, "pdserve_router_arrived_max_tokens_total") == 20.0
    assert sample(m, "pdserve_router_prompt_tokens_total") == 0.0  # not yet admitted
    timeline.opened(7, local_prefill=False)
    timeline.tokens(1)
    timeline.finished("stop", 5)
    assert sample(m, "pdserve_router_completion_tokens_total") == 5.0
    assert sample(m, "pdserve_router_finished_max_tokens_total") == 20.0  # it used a quarter of them


def test_a_request_neither_finished_nor_failed_is_logged_cancelled_once(clock):
    access, log = Served(), TimelineLog()
    timeline = RequestTimeline(metrics(), Tracing(TracingSettings(), "router"), log, "r1", access=access)
    clock.now = 100.5
    timeline.close()
    timeline.close()  # idempotent
    assert access.lines == [("r1", "", "cancelled", 0, 0, None, 0.5, None, None)]
    assert [sorted(e) for e in log.entries()] == [["arrived", "request_id"]]


def test_spans_nest_under_the_clients_trace_and_carry_the_outcome_and_servers():
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingSettings(), "router", exporter=exporter)
    timeline = RequestTimeline(metrics(), tracing, TimelineLog(), "r1", client_traceparent=CLIENT_TRACE)
    passed_on = timeline.traceparent
    assert passed_on is not None and passed_on.split("-")[1] == CLIENT_TRACE.split("-")[1]
    timeline.opened(2, local_prefill=False)
    timeline.tokens(1)
    timeline.tokens(1)
    timeline.failed("no_room")
    timeline.close(session("p1", "d1", "r1-retry1"), num_tokens=2)
    timeline.close(session("p1", "d1", "r1-retry1"), num_tokens=2)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["pdserve.request", "router.admission", "router.stream"]
    request = spans["pdserve.request"]
    assert len(exporter.get_finished_spans()) == 3  # closed once
    assert format(request.context.trace_id, "032x") == CLIENT_TRACE.split("-")[1]
    assert passed_on.split("-")[2] == format(request.context.span_id, "016x")
    assert {spans[n].parent.span_id for n in ("router.admission", "router.stream")} == {request.context.span_id}
    assert request.status.status_code == StatusCode.ERROR
    attributes = dict(request.attributes)
    assert attributes["pdserve.outcome"] == "no_room"
    assert attributes["pdserve.request_id"] == "r1"
    assert (attributes["pdserve.decode"], attributes["pdserve.prefill"]) == ("d1", "p1")
    assert attributes["pdserve.attempts"] == "r1-retry1"
    assert attributes["pdserve.generated_tokens"] == 2
    assert spans["router.stream"].attributes["pdserve.tokens"] == 2
    assert spans["router.admission"].attributes["pdserve.local_prefill"] is False


def test_without_tracing_nothing_is_passed_on():
    timeline = RequestTimeline(metrics(), Tracing(TracingSettings(), "router"), TimelineLog(), "r1", CLIENT_TRACE)
    assert timeline.traceparent is None
