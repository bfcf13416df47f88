"""Prometheus metrics of a prefill or decode server, on a registry of its own."""

from __future__ import annotations

from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server_common.engine_thread import Snapshot

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = r = CollectorRegistry()
        blocks = Gauge("pdserve_kv_blocks", "KV cache blocks by state", ["state"], registry=r)
        blocks.labels(state="free").set_function(lambda: snapshot().free)
        blocks.labels(state="reserved").set_function(lambda: snapshot().reserved)
        blocks.labels(state="running").set_function(lambda: snapshot().running)
        Gauge("pdserve_queue_depth", "Requests waiting to be scheduled", registry=r).set_function(
            lambda: snapshot().queue_depth)
        Gauge("pdserve_queued_tokens", "Prompt tokens not computed yet", registry=r).set_function(
            lambda: snapshot().queued_tokens)
        Gauge("pdserve_engine_requests", "Requests the engine holds", registry=r).set_function(
            lambda: snapshot().num_requests)
        Gauge("pdserve_torch_threads", "torch CPU threads", registry=r).set_function(torch.get_num_threads)
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.tokens = Counter("pdserve_generated_tokens", "Tokens produced", registry=r)
        self.transfer_bytes = Counter("pdserve_transfer_bytes", "KV bytes transferred", registry=r)
        self.transfer_seconds = Histogram("pdserve_transfer_seconds", "Time to transfer one request's KV",
                                          buckets=TRANSFER_BUCKETS, registry=r)
        self.lease_expired = Counter("pdserve_lease_expired", "Reservations freed at lease expiry", registry=r)
        self.transfer_failed = Counter("pdserve_transfer_failed", "Transfers that failed or were refused",
                                       registry=r)
