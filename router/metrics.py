"""The router's Prometheus metrics, on a registry of its own (no global state)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Annotations only: both halves (router/api/, router/cluster/) import this module, so at run time it imports
# neither (the acyclic_siblings contract in pyproject.toml).
if TYPE_CHECKING:
    from router.cluster.admission import Admission
    from router.cluster.registry import WorkerRegistry

# How a choice ended: OpenAI's finish_reason (router/api/api_responses.py) and the label of
# pdserve_router_finished_requests.
FinishReason = Literal["stop", "length", "tool_calls"]

# Why discovery refused a worker (router/cluster/discovery.py): the label of pdserve_router_workers_refused.
JoinRefusal = Literal["no_health_report", "bad_name", "other_model", "name_in_use"]
ENDPOINTS = ("chat", "completions", "responses")  # the label of pdserve_router_requests (router/app.py)

# The buckets vLLM's users already chart (time_to_first_token_seconds, inter_token_latency_seconds, ...).
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class RecoveryMetrics:
    """What went wrong with requests and what the router did about it."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.failures = Counter(
            "pdserve_router_step_failures",
            "Failed steps of requests by stage and outcome code",
            ["stage", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "pdserve_router_retries",
            "Requests started over after a failure before their "
            "first token, by action (retry: another prefill server, local: on the decode server)",
            ["action", "outcome"],
            registry=r,
        )
        self.migrations = Counter(
            "pdserve_router_migrations",
            "Requests moved to another decode server when their decode stream broke, by cause (outcome code)",
            ["cause"],
            registry=r,
        )
        self.reprefills = Counter(
            "pdserve_router_decode_reprefills",
            "Requests a decode server prefilled itself after the remote KV failed, by outcome code",
            ["outcome"],
            registry=r,
        )


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_router_requests", "Finished requests", ["endpoint", "status"], registry=r)
        self.inflight = Gauge("pdserve_router_inflight_requests", "Requests in flight", registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("pdserve_router_completion_tokens", "Generated tokens", registry=r)
        # Counted as a request arrives, before the waiting room: the work coming in, which the planner
        # reads as demand (deploy/planner.py), apart from the backlog being admitted.
        self.arrived_requests = Counter("pdserve_router_arrived_requests", "Requests arrived", registry=r)
        self.arrived_prompt_tokens = Counter(
            "pdserve_router_arrived_prompt_tokens", "Prompt tokens of the requests arrived", registry=r
        )
        self.arrived_max_tokens = Counter(
            "pdserve_router_arrived_max_tokens", "Tokens the requests arrived may generate (max_tokens)", registry=r
        )
        self.finished_max_tokens = Counter(
            "pdserve_router_finished_max_tokens", "Tokens the finished requests could have generated", registry=r
        )
        self._latency_metrics(r)
        self.finished = Counter(
            "pdserve_router_finished_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.local_prefills = Counter(
            "pdserve_router_local_prefills", "Requests prefilled on the decode server", registry=r
        )
        # By configured tenant only (router/cluster/tenancy.py): a request cannot add a label value.
        self.tenant_requests = Counter(
            "pdserve_router_tenant_requests",
            "Finished requests by tenant and HTTP status",
            ["tenant", "status"],
            registry=r,
        )
        self.recovery = RecoveryMetrics(r)
        # Background responses whose router died, carried on here (router/api/background.py).
        self.background_adoptions = Counter(
            "pdserve_router_background_adoptions",
            "Background responses this router took over from a router gone and carried on",
            registry=r,
        )
        r.register(_Workers(workers))  # workers join and leave: read at every scrape
        self._worker_metrics(r)
        self._zero_labels()

    def tenant_answered(self, tenant: str, status: int) -> None:
        self.tenant_requests.labels(tenant=tenant, status=str(status)).inc()

    def _latency_metrics(self, r: CollectorRegistry) -> None:
        """What a client waits: TTFT, ITL, TPOT, end to end, the queue; tokens per request."""
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Arrival at the router to the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_router_inter_token_latency_seconds",
            "Time between two generated tokens",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_router_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1)",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_request_latency_seconds",
            "Arrival at the router to the last token of a finished request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pdserve_router_request_queue_time_seconds",
            "Time a request waited for a free slot (0 when admitted at once)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens_per_request = Histogram(
            "pdserve_router_request_prompt_tokens", "Prompt tokens per request", buckets=TOKEN_COUNT_BUCKETS, registry=r
        )
        self.generation_tokens_per_request = Histogram(
            "pdserve_router_request_generation_tokens",
            "Generated tokens per finished request",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )

    def _worker_metrics(self, r: CollectorRegistry) -> None:
        """Workers discovery added, refused (by reason) and forgot."""
        self.workers_refused = Counter(
            "pdserve_router_workers_refused",
            "Workers discovery found but refused (another model, a name in use, ...)",
            ["reason"],
            registry=r,
        )
        self.workers_joined = Counter("pdserve_router_workers_joined", "Workers added at runtime", registry=r)
        self.workers_left = Counter(
            "pdserve_router_workers_left", "Workers drained and forgotten at runtime", registry=r
        )

    def _zero_labels(self) -> None:
        # Every known label value exported at 0 from the start, so rate() and absent() alerts work before
        # the first event (prometheus-client's advice for labelled metrics).
        for endpoint in ENDPOINTS:
            self.requests.labels(endpoint=endpoint, status="200")
        for reason in get_args(FinishReason):
            self.finished.labels(finish_reason=reason)
        for refusal in get_args(JoinRefusal):
            self.workers_refused.labels(reason=refusal)

    def watch_admission(self, admission: Admission, tenants: Iterable[str] = ()) -> None:
        """``tenants``: the configured tenants' names, the only label values of the per-tenant metrics."""
        Gauge(
            "pdserve_router_waiting_requests", "Requests waiting for a free slot", registry=self.registry
        ).set_function(lambda: admission.waiting)
        self.registry.register(_TenantSlots(admission, tuple(tenants)))


class _TenantSlots:
    """Each configured tenant's decode slots and the requests its share held back (router/cluster/fair_share.py),
    read from admission at every scrape; every configured tenant exported, at 0 before its first request."""

    def __init__(self, admission: Admission, tenants: tuple[str, ...]) -> None:
        self._admission = admission
        self._tenants = tenants

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        slots = GaugeMetricFamily(
            "pdserve_router_tenant_slots",
            "Decode slots the tenant's requests hold now (this router's)",
            labels=["tenant"],
        )
        held_back = CounterMetricFamily(
            "pdserve_router_tenant_held_back",
            "Requests that found a free decode slot the tenant's share left for other tenants, "
            "and none it could take (each counted once)",
            labels=["tenant"],
        )
        for name in self._tenants:
            slots.add_metric([name], self._admission.shares.holding(name))
            held_back.add_metric([name], self._admission.held_back[name])
        yield slots
        yield held_back


class _Workers:
    """Each worker's rotation, in-flight, queued and draining state, as the registry holds it now."""

    def __init__(self, workers: WorkerRegistry) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "pdserve_router_worker_healthy", "1 when the worker is in rotation", labels=["worker", "role"]
        )
        inflight = GaugeMetricFamily(
            "pdserve_router_worker_inflight", "Requests this router has on the worker", labels=["worker", "role"]
        )
        queued = GaugeMetricFamily(
            "pdserve_router_worker_queued_tokens",
            "Prompt tokens the worker reports not computed yet (its last health report)",
            labels=["worker", "role"],
        )
        draining = GaugeMetricFamily(
            "pdserve_router_worker_draining",
            "1 when the worker is draining (admin, its own report, or leaving)",
            labels=["worker", "role"],
        )
        for w in list(self._workers.workers):
            labels = [w.name, w.role]
            healthy.add_metric(labels, 1.0 if w.healthy else 0.0)
            inflight.add_metric(labels, w.inflight)
            queued.add_metric(labels, w.queued_tokens)
            draining.add_metric(labels, 1.0 if w.draining or w.reported_draining else 0.0)
        yield healthy
        yield inflight
        yield queued
        yield draining
