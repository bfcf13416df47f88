"""The router's Prometheus metrics, on a registry of its own (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.admission import Admission
from router.registry import WorkerRegistry

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RecoveryMetrics:
    """What went wrong with requests and what the router did about it."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.failures = Counter("pdserve_router_step_failures", "Failed steps of requests by stage and code",
                                ["stage", "code"], registry=r)
        self.retries = Counter("pdserve_router_retries", "Requests started over after a failure before their "
                               "first token, by action (retry: another prefill server, local: on the decode server)",
                               ["action", "cause"], registry=r)
        self.reprefills = Counter("pdserve_router_decode_reprefills", "Requests a decode server prefilled itself "
                                  "after the remote KV failed", ["cause"], registry=r)


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, admission: Admission | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_router_requests", "Finished requests", ["endpoint", "status"], registry=r)
        self.inflight = Gauge("pdserve_router_inflight_requests", "Requests in flight", registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("pdserve_router_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("pdserve_router_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_request_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.local_prefills = Counter("pdserve_router_local_prefills", "Requests prefilled on the decode server",
                                      registry=r)
        self.recovery = RecoveryMetrics(r)
        healthy = Gauge("pdserve_router_worker_healthy", "1 when the worker is in rotation", ["worker", "role"],
                        registry=r)
        for w in workers.workers:
            healthy.labels(worker=w.name, role=w.role).set_function(lambda w=w: 1.0 if w.healthy else 0.0)
        inflight = Gauge("pdserve_router_worker_inflight", "Requests this router has on the worker",
                         ["worker", "role"], registry=r)
        draining = Gauge("pdserve_router_worker_draining", "1 when the worker is draining (admin or its own report)",
                         ["worker", "role"], registry=r)
        for w in workers.workers:
            inflight.labels(worker=w.name, role=w.role).set_function(lambda w=w: w.inflight)
            draining.labels(worker=w.name, role=w.role).set_function(
                lambda w=w: 1.0 if w.draining or w.reported_draining else 0.0)
        if admission is not None:
            Gauge("pdserve_router_waiting_requests", "Requests waiting for a free slot", registry=r).set_function(
                lambda: admission.waiting)
