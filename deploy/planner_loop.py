"""The planner in the loop as a process of its own (`pdserve planner`, deploy/planner_cli.py).

Every ``planner.interval_s`` it scrapes the routers (deploy/planner_signals.py),
asks ``Planner.decide`` (deploy/planner.py) and, in ``act`` mode, carries the
decision out (deploy/planner_act.py). Each decision is one log line with its
reason, one JSON line in ``/decisions`` (the last 200) and the
``pdserve_planner_*`` metrics on ``/metrics``; ``/health`` answers as the
other processes' do, so `pdserve launch` can wait for it. In a pool that may
grow (``planner.max_instances``) a decision to start or stop an instance is
the launcher's to carry out, since it owns the processes: the planner says
what it wants at ``/wanted``, which the launcher reads every interval
(deploy/launch_scale.py), and holds its next change until the routers show
the new count in rotation (or ``RESIZE_PATIENCE_S`` passed). The HTTP
listener serves only those four reads, on the cluster's router host.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deploy.planner import Decision, EngineShape, Load, Orchestrator, Planner, PlannerSettings, Role, Slo
from deploy.planner_act import ActError, InstanceScale, PoolSwitch
from deploy.planner_signals import Routers, Snapshot, WorkerView, in_rotation, window
from engine.step_cost import DEFAULT_STEP_COST, load_step_cost

if TYPE_CHECKING:
    from deploy.config import ClusterConfig

log = logging.getLogger("pdserve.planner")
KEPT_DECISIONS = 200
RESIZE_PATIENCE_S = 300.0  # a start or stop the routers never show is given up after this
READ_TIMEOUT_S = 5.0
ROLES: tuple[Role, ...] = ("prefill", "decode")


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("pdserve_planner_decisions", "Decisions by action", ["action"], registry=r)
        self.act_failures = Counter(
            "pdserve_planner_act_failures", "Decisions that could not be carried out", registry=r
        )
        self.instances = Gauge("pdserve_planner_instances", "Instances in rotation per role", ["role"], registry=r)
        self.wanted = Gauge(
            "pdserve_planner_wanted_instances", "Instances the last decision wants", ["role"], registry=r
        )
        self.utilisation = Gauge(
            "pdserve_planner_utilisation", "Each role's demand over its instances (model)", ["role"], registry=r
        )
        self.correction = Gauge(
            "pdserve_planner_capacity_correction", "Observed over modelled capacity per role", ["role"], registry=r
        )
        self.rates = Gauge(
            "pdserve_planner_tokens_per_second", "Token rates arriving in the last window", ["kind"], registry=r
        )
        self.queued = Gauge(
            "pdserve_planner_prefill_queued_tokens",
            "Prompt tokens queued at the prefill servers at the last window's end",
            registry=r,
        )
        self.waiting = Gauge(
            "pdserve_planner_waiting_requests",
            "Requests in the routers' waiting rooms at the last window's end",
            registry=r,
        )
        self.cpu = Histogram(
            "pdserve_planner_decision_cpu_seconds",
            "CPU time of one decision (scrape parsing, model, decision)",
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5),
            registry=r,
        )
        for action in ("hold", "switch", "scale"):
            self.decisions.labels(action=action)


class PlannerLoop:
    """One planner's state between intervals: the recent scrapes, the decisions, what was carried out.

    Each decision reads the last ``window_s`` seconds of the routers' figures (the difference between the
    newest scrape and the oldest one within that span), however short the interval between decisions: a
    window must hold enough first tokens to say something (one long prompt a second gives a 1 s window
    none half the time). After a switch the history starts again. Each decision also gets the window's last
    part, since the scrape before (the planner's ``shift_parts``: a shift in the arrivals)."""

    def __init__(
        self,
        planner: Planner,
        routers: Routers,
        slo: Slo,
        act: PoolSwitch | InstanceScale | None,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.planner = planner
        self.routers = routers
        self.slo = slo
        self.act = act
        self.clock = clock
        self.metrics = PlannerMetrics()
        self.decisions: deque[dict] = deque(maxlen=KEPT_DECISIONS)
        self.window_s = window_s
        self._history: deque[tuple[float, dict[str, Snapshot]]] = deque()
        # What the launcher is asked for (``/wanted``): the pool's size per role, and the last change's
        # role and direction; ``seq`` counts the asks.
        self.wanted: dict | None = None
        self._asked_at = -float("inf")

    def step(self) -> Decision | None:
        """One interval: None on the first (it only takes the baseline scrape)."""
        cpu = time.process_time()
        now, scraped = self.clock(), self.routers.scrape()
        while len(self._history) > 1 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()  # the oldest kept is the newest at least window_s old, or the only one
        self._history.append((now, scraped))
        if len(self._history) == 1:
            return None
        since, base = self._history[0]
        load = window(base, scraped, now - since, self.slo.ttft_s, self.slo.tpot_s)
        last, previous = self._history[-2]
        recent = window(previous, scraped, now - last, self.slo.ttft_s, self.slo.tpot_s)
        workers = self.routers.workers()
        counts = {role: in_rotation(workers, role) for role in ROLES}
        resizing = self._resizing(counts, now)
        decision = self.planner.decide(load, counts["prefill"], counts["decode"], now, resizing, recent)
        self.metrics.cpu.observe(time.process_time() - cpu)
        done, changed = self._carry_out(decision, workers, counts, now)
        self._record(decision, load, recent, counts, done)
        if changed and decision.action == "switch":  # the counts changed: what came before is no guide
            self._history = deque([(self.clock(), self.routers.scrape())])
        return decision

    def _resizing(self, counts: dict[Role, int], now: float) -> bool:
        """Whether the launcher's start or stop of an instance is still to show in the routers' counts."""
        if self.wanted is None or now - self._asked_at > RESIZE_PATIENCE_S:
            return False
        return sum(counts.values()) != self.wanted["prefill"] + self.wanted["decode"]

    def _ask_launcher(self, decision: Decision, counts: dict[Role, int], now: float) -> str:
        """Publish a pool's new size at ``/wanted`` for the launcher (deploy/launch_scale.py)."""
        assert decision.switch_to is not None
        grow = decision.prefill + decision.decode > sum(counts.values())
        seq = 1 if self.wanted is None else self.wanted["seq"] + 1
        self.wanted = {
            "seq": seq,
            "prefill": decision.prefill,
            "decode": decision.decode,
            "change": "start" if grow else "stop",
            "role": decision.switch_to,
        }
        self._asked_at = now
        return f"asked the launcher to {self.wanted['change']} a {decision.switch_to} server"

    def _carry_out(
        self, decision: Decision, workers: list[WorkerView], counts: dict[Role, int], now: float
    ) -> tuple[str | None, bool]:
        """What was done about ``decision`` (None: nothing to do), and whether anything changed."""
        if self.act is None or decision.action == "hold":
            return None, False
        try:
            if isinstance(self.act, PoolSwitch):
                if decision.action == "scale":
                    return self._ask_launcher(decision, counts, now), False
                return self._switch(decision, workers)
            if decision.action != "scale":
                return None, False
            return f"scaled {self.act.apply(decision)}", True
        except ActError as exc:
            self.metrics.act_failures.inc()
            log.warning("could not carry out %s: %s", decision.action, exc)
            return f"failed: {exc}", False

    def _switch(self, decision: Decision, workers: list[WorkerView]) -> tuple[str, bool]:
        """The decision's ``moves`` switches, one after another, so no two are in flight; what was done
        ("switched A to prefill in 0.11 s; switched B ..."), stopping at the first that fails. The donors of
        several moves are chosen together and taken out of rotation at once before the first switch: a decode
        server's streams migrate off it then, and only onto servers that stay decode servers, not onto a
        donor switched next (which would move them again; a third move fails them, past the router's
        ``migration_limit``). A donor drained and not switched is put back in rotation."""
        assert isinstance(self.act, PoolSwitch) and decision.switch_to is not None
        to = decision.switch_to
        if decision.moves == 1:
            name, seconds = self.act.apply(decision, workers)
            return f"switched {name} to {to} in {seconds:.2f} s", True
        donors = [w.name for w in self.act.donors(workers, to, decision.moves)]
        self.act.drain(donors)  # all or none (the router checks every name first)
        done: list[str] = []
        for k, name in enumerate(donors):
            try:
                seconds = self.act.switch(name, to)
            except ActError as exc:
                self._resume(self.act, donors[k:])  # a refused switch leaves its donor drained, as the rest
                if not done:
                    raise
                self.metrics.act_failures.inc()
                log.warning("could not carry out switch %d of %d: %s", k + 1, decision.moves, exc)
                done.append(f"failed: {exc}")
                break
            done.append(f"switched {name} to {to} in {seconds:.2f} s")
        return "; ".join(done), True

    @staticmethod
    def _resume(act: PoolSwitch, names: list[str]) -> None:
        """Put drained donors back in rotation; one the router will not resume is logged and left."""
        for name in names:
            try:
                act.resume(name)
            except ActError as exc:
                log.warning("could not put %s back in rotation: %s", name, exc)

    def _record(self, decision: Decision, load: Load, recent: Load, counts: dict[Role, int], done: str | None) -> None:
        m = self.metrics
        m.decisions.labels(action=decision.action).inc()
        for role in ROLES:
            m.instances.labels(role=role).set(counts[role])
            m.correction.labels(role=role).set(self.planner.correction[role])
        m.wanted.labels(role="prefill").set(decision.prefill)
        m.wanted.labels(role="decode").set(decision.decode)
        for name, u in decision.utilisation.items():
            m.utilisation.labels(role=name).set(u)
        rate = self.planner.work(load).rate
        m.rates.labels(kind="prompt").set(rate["prefill"])
        m.rates.labels(kind="output").set(rate["decode"])
        m.queued.set(load.queued_tokens)
        m.waiting.set(load.waiting)
        entry = asdict(decision) | {
            "load": asdict(load),
            "recent": asdict(recent),
            "instances": counts,
            "carried_out": done,
        }
        self.decisions.append(entry)
        log.info(
            "%s %dP%dD (now %dP%dD): %s%s%s",
            decision.action,
            decision.prefill,
            decision.decode,
            counts["prefill"],
            counts["decode"],
            decision.reason,
            f"; {done}" if done else "",
            recent_note(recent),
        )

    def run(self, stop: threading.Event, interval_s: float) -> None:
        while True:
            try:
                self.step()
            except ConnectionError as exc:  # no router answered: nothing to decide on
                log.warning("%s", exc)
            if stop.wait(interval_s):
                return


def recent_note(recent: Load) -> str:
    """The window's last part as the log line gives it: what arrived, and the test against the rest."""
    if recent.arrived is None or recent.seconds <= 0:
        return f" [last {recent.seconds:.1f} s: {recent.requests} first tokens]"
    return (
        f" [last {recent.seconds:.1f} s: {recent.arrived} arrived, {recent.arrived_prompt_tokens / recent.seconds:.0f}"
        f" prompt and {recent.arrived_max_tokens / recent.seconds:.0f} max tokens a second]"
    )


def serve_reads(loop: PlannerLoop, host: str, port: int, launch_id: str | None) -> ThreadingHTTPServer:
    """/health, /metrics and /decisions, on a thread of their own. Nothing a caller sends is read beyond the
    request line and headers; any other method or path is a 404 or 501."""

    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # a client that sends its request slowly, or never, is dropped

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/health":
                body, kind = json.dumps({"status": "ok", "instance": "planner", "launch_id": launch_id}), "json"
            elif self.path == "/metrics":
                body, kind = generate_latest(loop.metrics.registry).decode(), "plain"
            elif self.path == "/decisions":
                body, kind = json.dumps({"decisions": list(loop.decisions)}), "json"
            elif self.path == "/wanted":
                body, kind = json.dumps({"launch_id": launch_id, "wanted": loop.wanted}), "json"
            else:
                self.send_error(404)
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", f"application/{kind}" if kind == "json" else "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="planner-http", daemon=True).start()
    return server


def build(cluster: ClusterConfig, config_path: Path) -> PlannerLoop:
    """The planner of ``cluster``'s ``planner`` section, reading its routers."""
    p = cluster.planner
    profile = p.profile or cluster.engine.mock_profile
    cost = load_step_cost(profile) if profile else DEFAULT_STEP_COST
    engine = cluster.engine
    kv_tokens = engine.num_blocks * engine.block_size if engine.num_blocks else 1 << 30
    shape = EngineShape(engine.max_num_seqs, engine.max_num_batched_tokens, kv_tokens)
    slo = Slo(p.ttft_s, p.tpot_s, p.attainment)
    orchestrator: Orchestrator = "scale" if p.orchestrator == "kubernetes" else "pool"
    settings = PlannerSettings(
        orchestrator,
        p.min_prefill,
        p.min_decode,
        min(p.max_prefill, len(cluster.prefill)) if orchestrator == "scale" else p.max_prefill,
        min(p.max_decode, len(cluster.decode)) if orchestrator == "scale" else p.max_decode,
        p.target_utilisation,
        p.hysteresis,
        p.max_moves,
        p.confirm,
        p.cooldown_s,
        min_instances=len(cluster.prefill) + len(cluster.decode),
        max_instances=p.max_instances if orchestrator == "pool" else None,
    )
    secret = cluster.security.secret()
    replicas = cluster.router.replicas
    urls = [cluster.router_replica_url(k) for k in range(replicas)] if replicas > 1 else [cluster.router_url]
    routers = Routers(urls, secret, dns=p.routers)
    act: PoolSwitch | InstanceScale | None = None
    if p.mode == "act" and orchestrator == "pool":
        act = PoolSwitch(cluster.router_url if p.routers is None else f"http://{p.routers}", secret)
    elif p.mode == "act":
        from deploy.k8s import cluster_name

        name = cluster_name(config_path, cluster.kubernetes)
        sets: dict[Role, list[str]] = {
            "prefill": [f"{name}-{i.name}" for i in cluster.prefill],
            "decode": [f"{name}-{i.name}" for i in cluster.decode],
        }
        act = InstanceScale(p.namespace, sets)
    return PlannerLoop(Planner(settings, cost, shape, slo), routers, slo, act, max(p.window_s, p.interval_s))


def serve(cluster: ClusterConfig, config_path: Path, launch_id: str | None) -> int:
    """Decide every interval until SIGTERM or SIGINT."""
    loop = build(cluster, config_path)
    server = serve_reads(loop, cluster.router_bind_host, cluster.planner.port, launch_id)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log.info(
        "%s, %s, every %g s, SLOs TTFT %g s and TPOT %g s at %g%%",
        cluster.planner.mode,
        cluster.planner.orchestrator,
        cluster.planner.interval_s,
        cluster.planner.ttft_s,
        cluster.planner.tpot_s,
        cluster.planner.attainment * 100,
    )
    try:
        loop.run(stop, cluster.planner.interval_s)
    finally:
        server.shutdown()
        server.server_close()
        loop.routers.close()
    return 0
