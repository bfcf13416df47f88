"""Prometheus metrics of a prefill or decode server, on a registry of its own.

Names follow one scheme (README, "Metrics"): ``pdserve_`` first, the unit last
(``_seconds``, ``_bytes``, ``_tokens``, ``_ratio``), ``_total`` on counters;
a failure is labelled with its ``transfer.outcome.Outcome`` code."""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine import EngineStats
from transfer.outcome import KV_NEVER_ARRIVED, Outcome

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
# pdserve_peer_refusals reasons: a decode server refused a hello (the name is bound to a live
# instance); a prefill server refused to re-point a decode server its config lists.
PEER_REFUSALS = ("bound_to_live_instance", "configured_peer")
BYTES_BUCKETS = tuple(float(1 << k) for k in range(12, 34, 2))  # 4 KiB .. 8 GiB
GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
AGE_BUCKETS = ((1.0, "lt_1s"), (10.0, "1s_10s"), (60.0, "10s_60s"), (float("inf"), "ge_60s"))
DISCARDED = (
    ("dropped_expired", "expired"),
    ("dropped_unknown", "unknown"),
    ("dropped_out_of_bounds", "out_of_bounds"),
    ("dropped_malformed", "malformed"),
    ("dropped_oversized", "oversized"),
    ("dropped_unbound_identity", "unbound_identity"),
    ("contained_errors", "error"),
)


def _engine_gauges(r: CollectorRegistry, stats: Callable[[], EngineStats]) -> None:
    """The engine's state read at each scrape from its published stats: blocks by state, queues, threads,
    block ages and steps."""
    sched = lambda: stats().scheduler  # noqa: E731
    blocks = Gauge("pdserve_kv_blocks", "KV cache blocks by state", ["state"], registry=r)
    blocks.labels(state="free").set_function(lambda: sched().free)
    blocks.labels(state="reserved").set_function(lambda: sched().reserved)
    blocks.labels(state="running").set_function(lambda: sched().running)
    Gauge(
        "pdserve_kv_blocks_cached",
        "Prefix-cached blocks with no owner (counted as free: evicted when needed)",
        registry=r,
    ).set_function(lambda: sched().cached)
    Gauge("pdserve_waiting_requests", "Requests waiting to be scheduled", registry=r).set_function(
        lambda: sched().queue_depth
    )
    Gauge("pdserve_running_requests", "Requests being computed (prefill or decode)", registry=r).set_function(
        lambda: sched().num_running
    )
    Gauge("pdserve_kv_cache_usage_ratio", "Share of KV blocks held (reserved or running)", registry=r).set_function(
        lambda: 1.0 - sched().free / max(1, sched().total)
    )
    Gauge("pdserve_queued_tokens", "Prompt tokens not computed yet", registry=r).set_function(
        lambda: sched().queued_tokens
    )
    Gauge("pdserve_engine_requests", "Requests the engine holds", registry=r).set_function(lambda: sched().num_requests)
    Gauge("pdserve_torch_threads", "torch CPU threads", registry=r).set_function(torch.get_num_threads)
    r.register(_BlockAges(stats))
    r.register(_EngineSteps(stats))
    r.register(_KvTiers(stats))


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = r = CollectorRegistry()
        _engine_gauges(r, stats)
        # How each request ended here, as an outcome code (transfer.outcome.Outcome: ok, no_room, aborted, ...);
        # the way a decode server computed its prompt is pdserve_request_paths.
        self.requests = Counter(
            "pdserve_requests", "Requests by how they ended here (an outcome code)", ["outcome"], registry=r
        )
        self.paths = Counter(
            "pdserve_request_paths",
            "Requests a decode server took, by how their prompt was "
            "computed: remote_kv (blocks reserved for a prefill server) or local_prefill",
            ["path"],
            registry=r,
        )
        self.tokens = Counter("pdserve_generated_tokens", "Tokens produced", registry=r)
        self._transfer_metrics(r)
        self._stage_metrics(r)
        self._zero_labels()
        self._discarded: _Discarded | None = None

    def _transfer_metrics(self, r: CollectorRegistry) -> None:
        """A KV transfer's bytes, time and rate, failures by outcome, what came of failures."""
        self.transfer_bytes = Counter("pdserve_transfer_bytes", "KV bytes transferred", registry=r)
        self.transfer_seconds = Histogram(
            "pdserve_transfer_seconds", "Time to transfer one request's KV", buckets=TRANSFER_BUCKETS, registry=r
        )
        self.transfer_request_bytes = Histogram(
            "pdserve_transfer_request_bytes", "KV bytes of one request", buckets=BYTES_BUCKETS, registry=r
        )
        self.transfer_gbps = Histogram(
            "pdserve_transfer_gigabytes_per_second",
            "One request's KV bytes over its transfer time",
            buckets=GBPS_BUCKETS,
            registry=r,
        )
        self.transfer_exposed_seconds = Histogram(
            "pdserve_transfer_exposed_seconds",
            "Prefill end (last layer computed, first token sampled) to the decode server's ack: "
            "the part of a KV transfer not hidden behind compute",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.transfer_failures = Counter(
            "pdserve_transfer_failures", "KV transfers that failed, by outcome code", ["outcome"], registry=r
        )
        self.reprefills = Counter(
            "pdserve_reprefills", "Requests prefilled locally after their remote KV failed", ["outcome"], registry=r
        )
        self.peer_refusals = Counter(
            "pdserve_peer_refusals",
            "Peer bindings refused: a hello under a name bound to another live instance, "
            "or a configured decode server re-pointed",
            ["reason"],
            registry=r,
        )

        # Decode-to-prefill reuse (kvlink/prefix_read.py): a decode server's reads of a reservation's cached
        # prefix; a prefill server's reads of it, by outcome (anything but ok is a miss, computed instead).
        self.prefix_reads = Counter(
            "pdserve_kv_prefix_reads",
            "Decode server: reads of a reservation's cached prefix by a prefill server, by outcome code",
            ["outcome"],
            registry=r,
        )
        self.prefix_pulls = Counter(
            "pdserve_kv_prefix_pulls",
            "Prefill server: reads of a decode server's cached prefix, by outcome code (not ok: computed here; "
            "not_worth_it: not asked for, computing was estimated faster)",
            ["outcome"],
            registry=r,
        )
        self.prefix_pulled_tokens = Counter(
            "pdserve_kv_prefix_pulled_tokens",
            "Prefill server: prompt tokens whose K/V was read from the decode server instead of computed",
            registry=r,
        )
        self.prefix_pulled_bytes = Counter(
            "pdserve_kv_prefix_pulled_bytes",
            "Prefill server: bytes of K/V read from decode servers' cached prefixes",
            registry=r,
        )
        self.prefix_pull_seconds = Histogram(
            "pdserve_kv_prefix_pull_seconds",
            "Prefill server: one read of a decode server's cached prefix, asked to checked (ok ones)",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        # The read-versus-compute rule's current estimates (prefill_server/pull_rule.py): a read of N tokens
        # costs about 5 ms + N * bytes a token / the first; computing them, N / the second.
        self.prefix_read_bytes_per_s = Gauge(
            "pdserve_kv_prefix_read_bytes_per_second",
            "Prefill server: the bandwidth of prefix reads beyond their fixed cost, as estimated (EWMA)",
            registry=r,
        )
        self.prefix_compute_tokens_per_s = Gauge(
            "pdserve_kv_prefix_compute_tokens_per_second",
            "Prefill server: its engine's prefill throughput that a prefix read is weighed against (EWMA)",
            registry=r,
        )

    def _stage_metrics(self, r: CollectorRegistry) -> None:
        """How long a request spent in each stage on this server."""
        self.kv_wait_seconds = Histogram(
            "pdserve_kv_wait_seconds",
            "Decode server: reservation made to its KV verified",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.prefill_queue_seconds = Histogram(
            "pdserve_prefill_queue_seconds",
            "Prefill server: request received to its first chunk computed",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.prefill_compute_seconds = Histogram(
            "pdserve_prefill_compute_seconds",
            "Prefill server: first chunk to first token sampled",
            buckets=STAGE_BUCKETS,
            registry=r,
        )

    def _zero_labels(self) -> None:
        # Every known label value exported at 0 from the start, so rate() and absent() alerts work before
        # the first failure (prometheus-client's advice for labelled metrics).
        for code in Outcome:
            if code is not Outcome.OK:
                self.transfer_failures.labels(outcome=code)
        for cause in sorted(KV_NEVER_ARRIVED):
            self.reprefills.labels(outcome=cause)
        for reason in PEER_REFUSALS:
            self.peer_refusals.labels(reason=reason)

    def watch_transfers(self, counters: Callable[[], dict[str, int]]) -> None:
        """Export a KV receiver's counters: writes and notices discarded by transfer id. A later receiver
        (a server switched back to decode, deploy/role_server.py) carries the counts on from the last one's."""
        if self._discarded is None:
            self._discarded = _Discarded(counters)
            self.registry.register(self._discarded)
        else:
            self._discarded.follow(counters)


class _BlockAges:
    """pdserve_kv_blocks_by_age{state,age} and the oldest holder's age per state: a
    reservation or request that never ends shows up here long before the cache fills."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        now = time.monotonic()
        by_age = GaugeMetricFamily(
            "pdserve_kv_blocks_by_age", "Held KV blocks by state and age of their request", labels=["state", "age"]
        )
        oldest = GaugeMetricFamily(
            "pdserve_kv_oldest_block_seconds", "Age of the oldest request holding blocks", labels=["state"]
        )
        for state in ("reserved", "running"):
            ages = [(now - arrival, n) for s, arrival, n in self._stats().scheduler.holders if s == state]
            low = 0.0
            for high, label in AGE_BUCKETS:
                by_age.add_metric([state, label], sum(n for age, n in ages if low <= age < high))
                low = high
            oldest.add_metric([state], max((age for age, _ in ages), default=0.0))
        yield by_age
        yield oldest


class _EngineSteps:
    """The engine's own step counters: how long its prefill, decode and mixed
    steps take on this machine, and how often it preempts."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        c = self._stats().counters
        steps = CounterMetricFamily(
            "pdserve_engine_steps", "Engine steps by kind (prefill, decode, mixed)", labels=["kind"]
        )
        seconds = CounterMetricFamily(
            "pdserve_engine_step_seconds", "Seconds spent in engine steps by kind", labels=["kind"]
        )
        for kind, n in c.steps.items():
            steps.add_metric([kind], n)
            seconds.add_metric([kind], c.step_seconds[kind])
        tokens = CounterMetricFamily("pdserve_engine_tokens", "Tokens computed, prompt or decode", labels=["kind"])
        tokens.add_metric(["prompt"], c.prompt_tokens)
        tokens.add_metric(["decode"], c.decode_tokens)
        yield steps
        yield seconds
        yield tokens
        yield CounterMetricFamily(
            "pdserve_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=c.prefix_queries_tokens,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cache_hits_tokens",
            "Prompt tokens found in the prefix cache (K/V reused, not computed)",
            value=c.prefix_hits_tokens,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cache_tier_hits_tokens",
            "Of the prefix cache's hits, tokens whose K/V was loaded from a KV tier (host memory, disk)",
            value=c.tier_hits_tokens,
        )
        yield CounterMetricFamily(
            "pdserve_preemptions", "Running requests preempted (freed, recomputed later)", value=c.preemptions
        )


class _KvTiers:
    """Each KV tier's counters (engine/tiers/), labelled by tier (host, disk); nothing when the server has
    no tiers."""

    COUNTERS = (
        ("hits", "pdserve_kv_tier_hits", "Blocks a KV tier served (loaded instead of computed)"),
        ("misses", "pdserve_kv_tier_misses", "Blocks asked of a KV tier and not served (absent or corrupt)"),
        ("corrupt", "pdserve_kv_tier_corrupt_entries", "KV tier entries whose checksum or length was wrong"),
        ("dropped_writes", "pdserve_kv_tier_dropped_writes", "Blocks not written to a KV tier (queue full, too big)"),
        ("bytes_read", "pdserve_kv_tier_read_bytes", "Bytes loaded from a KV tier"),
        ("bytes_written", "pdserve_kv_tier_written_bytes", "Bytes written to a KV tier"),
        ("evictions", "pdserve_kv_tier_evictions", "KV tier entries dropped to stay within its byte limit"),
        ("errors", "pdserve_kv_tier_errors", "Calls to a shared KV store that failed (down, slow): misses"),
    )

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        tiers = self._stats().tiers
        for key, name, help_text in self.COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=["tier"])
            for tier in tiers:
                family.add_metric([tier.name], getattr(tier, key))
            yield family
        held = GaugeMetricFamily("pdserve_kv_tier_held_bytes", "Bytes a KV tier holds now", labels=["tier"])
        limit = GaugeMetricFamily("pdserve_kv_tier_limit_bytes", "A KV tier's byte limit", labels=["tier"])
        for tier in tiers:
            held.add_metric([tier.name], tier.bytes_held)
            limit.add_metric([tier.name], tier.max_bytes)
        yield held
        yield limit
        yield from self._tenants(tiers)

    @staticmethod
    def _tenants(tiers):
        """The shared store's per-tenant shares (engine/tiers/redis_shares.py), when it holds tenants to them:
        labelled by tenant, each a configured tenant's name (checked where it arrived)."""
        held = GaugeMetricFamily(
            "pdserve_kv_store_tenant_bytes",
            "Bytes the shared KV store charges a tenant, as counted at this server's last write to it",
            labels=["tenant"],
        )
        share = GaugeMetricFamily(
            "pdserve_kv_store_tenant_share_bytes", "Each tenant's share of the shared KV store", labels=["tenant"]
        )
        refused = CounterMetricFamily(
            "pdserve_kv_store_tenant_refused_writes",
            "This server's writes to the shared KV store refused for a tenant (over its share, or the store full)",
            labels=["tenant"],
        )
        evicted = CounterMetricFamily(
            "pdserve_kv_store_tenant_evictions",
            "A tenant's own blocks this server's writes for it evicted from the shared KV store to stay in its share",
            labels=["tenant"],
        )
        for tier in tiers:
            for t in tier.tenants:
                held.add_metric([t.tenant], t.bytes_held)
                share.add_metric([t.tenant], t.share)
                refused.add_metric([t.tenant], t.refused_writes)
                evicted.add_metric([t.tenant], t.evictions)
        yield from (held, share, refused, evicted)


class _Discarded:
    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self._counters = counters
        self._before: Tally[str] = Tally()  # the counts of the receivers before this one

    def follow(self, counters: Callable[[], dict[str, int]]) -> None:
        """Count from ``counters`` now, on top of everything counted so far: a counter never goes back."""
        self._before.update(self._counters())
        self._counters = counters

    def collect(self):
        counts = self._before + Tally(self._counters())
        family = CounterMetricFamily(
            "pdserve_transfers_discarded",
            "KV writes and notices dropped by transfer id, never applied",
            labels=["reason"],
        )
        for key, reason in DISCARDED:
            family.add_metric([reason], counts.get(key, 0))
        yield family
