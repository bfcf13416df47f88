"""What the planner reads: the routers' /metrics as a ``Load`` per window, and the workers in rotation.

Each router counts what passes through it (router/metrics.py): prompt and
generated tokens, and histograms of TTFT and TPOT. The planner scrapes every
router (every replica, not the front, which would answer for one of them at
random), adds the figures up, and takes the difference between two scrapes
as one window. Output tokens are counted as they stream (a first token
in the TTFT histogram, every later one in the inter-token histogram),
not when their request finishes, so a window of long answers is not
seen a whole answer late. The share of requests within an SLO is read off the
histogram's buckets, linearly between the two bounds around the target, as
Prometheus' ``histogram_quantile`` does the other way round. A router that
restarted (a counter went down) contributes nothing to that window.

The work arriving is counted apart, as each request comes in, before the
waiting room: requests, their prompt tokens and the tokens they may
generate (max_tokens); and as each finishes, the max_tokens it had, beside
the tokens it generated. The planner's demand is these arrivals, not what
the routers admit: a backlog being admitted is not new work.

What is queued is read at both ends of the window: the requests in each
router's waiting room (its own, so added up), and the prompt tokens each
prefill server reported queued in its last health check (every router
polls every server, so each server is counted once, at the most any
router saw).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deploy.planner import Load, Role

PROMPT = "pdserve_router_prompt_tokens"
OUTPUT = "pdserve_router_completion_tokens"
TTFT = "pdserve_router_time_to_first_token_seconds"
TPOT = "pdserve_router_time_per_output_token_seconds"
ITL = "pdserve_router_inter_token_latency_seconds"
WAITING = "pdserve_router_waiting_requests"
QUEUED = "pdserve_router_worker_queued_tokens"
ARRIVED = "pdserve_router_arrived_requests"
ARRIVED_PROMPT = "pdserve_router_arrived_prompt_tokens"
ARRIVED_MAX = "pdserve_router_arrived_max_tokens"
FINISHED_MAX = "pdserve_router_finished_max_tokens"
COUNTERS = (PROMPT, OUTPUT, ARRIVED, ARRIVED_PROMPT, ARRIVED_MAX, FINISHED_MAX)


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last
    count: float

    def within(self, bound: float) -> float:
        """Samples at or under ``bound``: exact at a bucket's bound, linear between two."""
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if bound <= le:
                if le == float("inf"):
                    return below
                return below + (cumulative - below) * (bound - lower) / (le - lower)
            lower, below = le, cumulative
        return below

    def minus(self, earlier: Histogram) -> Histogram:
        before = dict(earlier.buckets)
        return Histogram(tuple((le, c - before.get(le, 0.0)) for le, c in self.buckets), self.count - earlier.count)


@dataclass(frozen=True)
class Snapshot:
    """One router's counters at one scrape."""

    prompt_tokens: float = 0.0
    output_tokens: float = 0.0  # counted when a request finishes
    later_tokens: float = 0.0  # every token after a request's first, counted as it streams (the ITL samples)
    ttft: Histogram = field(default_factory=lambda: Histogram((), 0.0))
    tpot: Histogram = field(default_factory=lambda: Histogram((), 0.0))
    waiting: float = 0.0  # requests in its waiting room
    queued: tuple[tuple[str, float], ...] = ()  # (prefill server, prompt tokens it reported queued)
    arrived: float | None = None  # requests arrived (before the waiting room); None: a router that does not count
    arrived_prompt: float = 0.0  # their prompt tokens
    arrived_max: float = 0.0  # the tokens they may generate (max_tokens)
    finished_max: float = 0.0  # the tokens the finished requests could have generated


def parse_metrics(text: str) -> Snapshot:
    """The planner's figures from one /metrics page."""
    values: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {TTFT: [], TPOT: []}
    queued: list[tuple[str, float]] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (*(f"{c}_total" for c in COUNTERS), f"{TTFT}_count", f"{TPOT}_count", f"{ITL}_count"):
                values[s.name] = s.value
            elif s.name == WAITING:
                values[s.name] = s.value
            elif s.name == QUEUED and s.labels.get("role") == "prefill":
                queued.append((s.labels["worker"], s.value))
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in buckets:
                buckets[s.name[: -len("_bucket")]].append((float(s.labels["le"]), s.value))
    return Snapshot(
        values.get(f"{PROMPT}_total", 0.0),
        values.get(f"{OUTPUT}_total", 0.0),
        values.get(f"{ITL}_count", 0.0),
        Histogram(tuple(sorted(buckets[TTFT])), values.get(f"{TTFT}_count", 0.0)),
        Histogram(tuple(sorted(buckets[TPOT])), values.get(f"{TPOT}_count", 0.0)),
        values.get(WAITING, 0.0),
        tuple(sorted(queued)),
        values.get(f"{ARRIVED}_total"),
        values.get(f"{ARRIVED_PROMPT}_total", 0.0),
        values.get(f"{ARRIVED_MAX}_total", 0.0),
        values.get(f"{FINISHED_MAX}_total", 0.0),
    )


def prefill_queued(snapshots: list[Snapshot]) -> float:
    """Prompt tokens queued at the prefill servers: each server once, at the most any router saw."""
    most: dict[str, float] = {}
    for snapshot in snapshots:
        for worker, tokens in snapshot.queued:
            most[worker] = max(most.get(worker, 0.0), tokens)
    return sum(most.values())


def window(
    before: dict[str, Snapshot], after: dict[str, Snapshot], seconds: float, ttft_s: float, tpot_s: float
) -> Load:
    """The load between two scrapes of the same routers (by URL); a router new or restarted since is left out
    (of the queues too: its waiting room at the start is not known). The arrivals are counted only when every
    router counts them (a router of an earlier version does not)."""
    prompt = output = requests = 0.0
    arrived: float | None = 0.0
    arrived_prompt = arrived_max = finished = finished_max = 0.0
    ttft_ok = tpot_ok = tpot_n = 0.0
    waiting = waiting_before = 0.0
    for url, now in after.items():
        then = before.get(url)
        if then is None or now.prompt_tokens < then.prompt_tokens or now.ttft.count < then.ttft.count:
            continue
        waiting += now.waiting
        waiting_before += then.waiting
        ttft, tpot = now.ttft.minus(then.ttft), now.tpot.minus(then.tpot)
        prompt += now.prompt_tokens - then.prompt_tokens
        output += now.later_tokens - then.later_tokens + ttft.count  # tokens as they streamed, first ones too
        requests += ttft.count
        ttft_ok += ttft.within(ttft_s)
        tpot_ok += tpot.within(tpot_s)
        tpot_n += tpot.count
        finished += now.output_tokens - then.output_tokens
        finished_max += now.finished_max - then.finished_max
        if arrived is None or now.arrived is None or then.arrived is None:
            arrived = None
            continue
        arrived += now.arrived - then.arrived
        arrived_prompt += now.arrived_prompt - then.arrived_prompt
        arrived_max += now.arrived_max - then.arrived_max
    return Load(
        seconds,
        round(requests),
        round(prompt),
        round(output),
        ttft_ok / requests if requests else None,
        tpot_ok / tpot_n if tpot_n else None,
        round(prefill_queued(list(after.values()))),
        round(waiting),
        round(prefill_queued(list(before.values()))),
        round(waiting_before),
        None if arrived is None else round(arrived),
        round(arrived_prompt),
        round(arrived_max),
        round(finished),
        round(finished_max),
    )


@dataclass(frozen=True)
class WorkerView:
    name: str
    role: str
    in_rotation: bool
    inflight: int


class Routers:
    """Scrapes the routers; ``workers`` asks the first that answers (each router knows every worker).
    ``dns`` (HOST:PORT): the routers are the addresses HOST resolves to, looked up at every scrape (a
    Kubernetes headless Service: one address per ready router pod), instead of ``urls``."""

    def __init__(self, urls: list[str], secret: str | None, timeout_s: float = 5.0, dns: str | None = None) -> None:
        self._urls = urls
        self.dns = dns
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    @property
    def urls(self) -> list[str]:
        if self.dns is None:
            return self._urls
        host, port = self.dns.rsplit(":", 1)
        try:
            found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError:
            return []
        addresses = sorted({str(a[4][0]) for a in found})
        return [f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses]

    def scrape(self) -> dict[str, Snapshot]:
        """Every router that answers, by URL."""
        found = {}
        for url in self.urls:
            try:
                r = self._http.get(f"{url}/metrics")
                r.raise_for_status()
            except httpx.HTTPError:
                continue
            found[url] = parse_metrics(r.text)
        return found

    def workers(self) -> list[WorkerView]:
        last: Exception | None = None
        for url in self.urls:
            try:
                r = self._http.get(f"{url}/admin/workers")
                r.raise_for_status()
                return [
                    WorkerView(w["name"], w["role"], bool(w["in_rotation"] and w["healthy"]), int(w["inflight"]))
                    for w in r.json()["workers"]
                ]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                last = exc
        raise ConnectionError(f"no router answered /admin/workers ({last})")

    def close(self) -> None:
        self._http.close()


def in_rotation(workers: list[WorkerView], role: Role) -> int:
    return sum(1 for w in workers if w.role == role and w.in_rotation)
