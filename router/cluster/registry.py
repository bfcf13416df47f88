"""The workers the router knows, their health and load.

Workers come from config, and join and leave at runtime (``add`` and
``forget``, called by ``router.cluster.discovery``). A background task per
worker polls its ``GET /health`` every ``health_interval_s`` seconds (waiting
``health_timeout_s`` for the answer), busy or not: real traffic shows a worker
alive (passive health, router/cluster/health.py, which also takes a worker out
on failed requests) but says nothing of its load, which only the poll reports. A worker that fails
``unhealthy_after`` checks in a row is taken out of rotation; the next
successful check brings it back. A check that times out counts only while
this router has nothing in flight on the worker: a busy worker answers its
requests, and a slow health answer is load, not a fault. While a worker fails,
its checks back off (interval, 2x, 4x, ... up to ``health_backoff_max_s``) so a dead
worker costs little, and a restarted one is back within ``health_backoff_max_s``. The
same poll refreshes the load a worker reports (free KV blocks, queue depth,
queued prompt tokens) for the least-loaded policy.

A draining worker (drained through the router's admin endpoint, or one that
reports ``status: draining`` because it was told to drain or got SIGTERM) is
healthy but out of rotation: it gets no new request and finishes its own.

With a ``launch_id`` (the router was started by ``pdserve launch``), a worker
counts as healthy only when its /health reports that same launch and its own
name: whatever else answers on its port belongs to another cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from engine.request import kv_blocks_needed
from router.settings import RouterSettings, WorkerRole

log = logging.getLogger(__name__)


@dataclass
class Worker:
    """One worker as this router sees it. Its fields are read anywhere (policies, metrics, admin views)
    and written only through the methods below: health checks, passive health, admission and the
    admin endpoint each call the method for what happened, and the state change is written here once."""

    name: str
    role: WorkerRole
    url: str  # http://host:port, no trailing slash
    healthy: bool = True
    failures: int = 0  # consecutive failed health checks
    last_seen: float = 0.0  # monotonic time of the last answer to a real call (router/cluster/health.py)
    request_failures: int = 0  # real calls failed in a row (router/cluster/health.py)
    # reported by the worker's /health
    free_blocks: int = 0
    queue_depth: int = 0
    queued_tokens: int = 0
    reported_draining: bool = False  # the worker's /health says "draining"
    total_blocks: int = 0  # its KV cache's blocks (0: not reported)
    block_size: int = 0  # tokens a block holds (0: not reported)
    # this router's own view, updated per request
    inflight: int = 0
    inflight_tokens: int = 0
    max_inflight: int | None = None  # per-worker in-flight limit; None: no limit
    draining: bool = False  # drained through the router's admin endpoint
    full_until: float = 0.0  # monotonic time until which a "no room" answer is trusted
    discovered: bool = False  # joined at runtime (router/cluster/discovery.py): another launch may have started it
    role_epoch: int | None = None  # its role epoch (deploy/role_server.py), sent with each call; None: not reported
    rejoin: bool = False  # lost during a role switch: joined again (its peers told) once it answers

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.draining and not self.reported_draining

    def has_room(self, now: float | None = None) -> bool:
        """Below its in-flight limit and not known to be full."""
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            return False
        return (time.monotonic() if now is None else now) >= self.full_until

    # ---- health (router/cluster/registry.py, router/cluster/health.py) ----------------------------
    def check_passed(self, report: dict) -> bool:
        """A health check answered with ``report``; True if it was out and is back."""
        self.apply_health(report)
        back = not self.healthy
        self.failures, self.healthy = 0, True
        return back

    def check_missed(self, unhealthy_after: int) -> bool:
        """A health check failed; True if this miss takes it out of rotation."""
        self.failures += 1
        if self.failures >= unhealthy_after and self.healthy:
            self.healthy = False
            return True
        return False

    def take_out(self, unhealthy_after: int) -> bool:
        """A call could not reach it: out until a check passes; True if it was in."""
        was_healthy, self.healthy = self.healthy, False
        self.failures = max(self.failures, unhealthy_after)
        return was_healthy

    def answered(self) -> None:
        """It answered a real call: alive now."""
        self.last_seen = time.monotonic()
        self.request_failures = 0

    def call_failed(self, failures_to_leave: int) -> bool:
        """A real call failed; True (and the count restarts) once ``failures_to_leave`` failed in a row."""
        self.request_failures += 1
        if self.request_failures < failures_to_leave:
            return False
        self.request_failures = 0
        return True

    # ---- this router's load on it (router/cluster/admission.py) -----------------------------------
    def started(self, num_tokens: int = 0) -> None:
        self.inflight += 1
        self.inflight_tokens += num_tokens

    def ended(self, num_tokens: int = 0, *, freed: bool = False) -> None:
        """A call ended; ``freed``: its KV blocks are free, so a "no room" answer no longer holds."""
        self.inflight -= 1
        self.inflight_tokens -= num_tokens
        if freed:
            self.full_until = 0.0

    def full_for(self, cooldown: float) -> None:
        """It said its KV cache is full: skip it for ``cooldown`` s (or until one of its calls frees blocks)."""
        self.full_until = time.monotonic() + cooldown

    def lost_in_switch(self) -> None:
        """It did not answer after its role switch: out of rotation until it answers and joins again."""
        self.draining, self.rejoin = True, True

    def other_role(self, report: dict) -> str | None:
        """Why ``report`` (its /health) is of another role than this router's view, or None."""
        reported = report.get("role")
        if reported is not None and {"colocated": "decode"}.get(reported, reported) != self.role:
            return f"it reports role {str(reported)[:16]!r}, not {self.role}"
        return None

    def changed_since(self, report: dict) -> str | None:
        """Why ``report`` (its /health) is not the worker this router knows, or None: another role (it
        switched without this router, or was restarted in another role), another role epoch (a switch,
        or a new process), or it was lost during a switch."""
        other = self.other_role(report)
        if other is not None:
            return other
        epoch = report.get("role_epoch")
        if self.role_epoch is not None and isinstance(epoch, int) and epoch != self.role_epoch:
            return f"it reports role epoch {epoch}, not {self.role_epoch}"
        return "it answers again after its role switch" if self.rejoin else None

    def set_draining(self, draining: bool) -> None:
        """Drained (or resumed) through the router's admin endpoint."""
        self.draining = draining

    def apply_health(self, report: dict) -> None:
        blocks = report.get("kv_blocks", {})
        self.free_blocks = int(blocks.get("free", 0))
        self.queue_depth = int(report.get("queue_depth", 0))
        self.queued_tokens = int(report.get("queued_tokens", 0))
        self.reported_draining = report.get("status") == "draining"
        epoch = report.get("role_epoch")
        self.role_epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
        self.total_blocks = int(blocks.get("total", 0))
        self.block_size = int(blocks.get("block_size", 0))

    @property
    def capacity_tokens(self) -> int:
        """The most tokens its KV cache holds (0: not reported)."""
        return self.total_blocks * self.block_size

    def can_hold(self, tokens: int) -> bool:
        """Whether its KV cache could ever hold ``tokens`` (True while it has not said how much it holds)."""
        return self.capacity_tokens == 0 or tokens <= self.capacity_tokens

    def blocks_per_request(self, share: float) -> int:
        """The most blocks one request may need here: ``share`` of its cache."""
        return int(share * self.total_blocks)

    def holds_request(self, num_prompt_tokens: int, max_tokens: int, n: int, share: float) -> bool:
        """Whether a request's whole KV need (``engine.request.kv_blocks_needed``) is within
        ``share`` of its cache (True while it has not said how much it holds)."""
        if not self.capacity_tokens:
            return True
        return kv_blocks_needed(num_prompt_tokens, max_tokens, n, self.block_size) <= self.blocks_per_request(share)

    def most_new_tokens(self, num_prompt_tokens: int, n: int, share: float) -> int:
        """The largest ``max_tokens`` for which ``holds_request`` is True (0: none is)."""
        allowed = self.blocks_per_request(share)
        shared = num_prompt_tokens // self.block_size
        own = (allowed - shared) // n  # blocks each sequence may have past the shared ones
        return max(0, (shared + own) * self.block_size - num_prompt_tokens) if own > 0 else 0


class WorkerRegistry:
    def __init__(
        self,
        workers: list[Worker],
        *,
        health_interval_s: float = RouterSettings.health_interval_s,
        health_timeout_s: float = RouterSettings.health_timeout_s,
        unhealthy_after: int = 2,
        health_backoff_max_s: float = RouterSettings.health_backoff_max_s,
        launch_id: str | None = None,
        stream_stall_s: float = RouterSettings.stream_stall_s,
    ) -> None:
        names = [w.name for w in workers]
        assert len(names) == len(set(names)), f"duplicate worker names: {names}"
        self.workers = workers
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = unhealthy_after
        self.health_backoff_max_s = max(health_backoff_max_s, health_interval_s)
        self.launch_id = launch_id
        # a busy worker silent this long (no answer to any call) is no longer let off
        self.stream_stall_s = stream_stall_s
        self._client: httpx.AsyncClient | None = None  # set by run(): new workers are watched at once
        # Told of a worker that changed (``Worker.changed_since``); router.cluster.discovery joins it again.
        self.on_changed: Callable[[Worker], None] | None = None
        self._watches: dict[str, asyncio.Task] = {}

    def healthy(self, role: WorkerRole) -> list[Worker]:
        """Workers of ``role`` in rotation: healthy and not draining."""
        return [w for w in self.workers if w.role == role and w.in_rotation]

    def find(self, name: str) -> Worker | None:
        return next((w for w in self.workers if w.name == name), None)

    def of_role(self, role: WorkerRole) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def mark_down(self, worker: Worker, reason: str) -> None:
        """A request could not reach the worker: out of rotation until a health check passes."""
        if worker.take_out(self.unhealthy_after):
            log.warning("worker %s (%s) taken out: %s", worker.name, worker.url, reason)

    async def check_once(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._check(client, w) for w in self.workers))

    async def _check(self, client: httpx.AsyncClient, worker: Worker) -> None:
        try:
            resp = await client.get(f"{worker.url}/health", timeout=self.health_timeout_s)
            resp.raise_for_status()
            report = resp.json()
            if worker.discovered:  # started by another launch, maybe: the same instance must answer
                foreign = report.get("instance") != worker.name
            else:
                foreign = self.launch_id is not None and (report.get("launch_id"), report.get("instance")) != (
                    self.launch_id,
                    worker.name,
                )
            changed = None if foreign else worker.changed_since(report)
            if changed is not None and self.on_changed is not None:
                # A new role or epoch (switched without this router, restarted): out of rotation until it joins
                # again as it reports itself (router.cluster.discovery.Discovery.readmit), never half-served.
                self.mark_down(worker, changed)
                self.on_changed(worker)
                return
            other = None if foreign else worker.other_role(report)
            if other is not None:  # and nothing here joins it again: out
                self.mark_down(worker, other)
                return
            if foreign:
                self.mark_down(
                    worker,
                    f"another process answers on its port (launch {report.get('launch_id')!r}, "
                    f"instance {report.get('instance')!r})",
                )
                return
            back = worker.check_passed(report)
        except httpx.TimeoutException as exc:
            # Idle and silent: a miss. Busy: its requests speak for it, while they do (a live decode
            # server's streams carry a heartbeat); a frozen one's have been silent for ``stream_stall_s``.
            if worker.inflight == 0 or time.monotonic() - worker.last_seen >= self.stream_stall_s:
                self._missed(worker, exc)
            return
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # no answer, or not a health report
            self._missed(worker, exc)
            return
        if back:
            log.info("worker %s (%s) healthy again", worker.name, worker.url)

    def _missed(self, worker: Worker, exc: Exception) -> None:
        if worker.check_missed(self.unhealthy_after):
            log.warning("worker %s (%s) unhealthy: %s", worker.name, worker.url, exc)

    def next_check_in(self, worker: Worker) -> float:
        """Seconds to the worker's next check: ``health_interval_s`` while it answers, then doubling."""
        if worker.failures == 0:
            return self.health_interval_s
        return min(self.health_interval_s * 2 ** min(worker.failures - 1, 30), self.health_backoff_max_s)

    @staticmethod
    async def drain(worker: Worker, timeout: float, poll: float = 0.05) -> None:
        """Take ``worker`` out of rotation and wait (at most ``timeout`` s) until its requests finished."""
        worker.set_draining(True)
        deadline = time.monotonic() + timeout
        while worker.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(poll)

    def add(self, worker: Worker) -> None:
        """A worker joins (its health is checked at once when the registry runs)."""
        if self.find(worker.name) is not None:
            raise ValueError(f"a worker named {worker.name!r} is already known")
        self.workers.append(worker)
        if self._client is not None:
            self._watches[worker.name] = asyncio.create_task(self._watch(self._client, worker))

    def replace(self, old: Worker, new: Worker) -> None:
        """``new`` takes ``old``'s place (the same worker, joined again: router.cluster.discovery), in one
        step: the name is never missing from the registry meanwhile."""
        self.workers[self.workers.index(old)] = new
        watch = self._watches.pop(old.name, None)
        if watch is not None:
            watch.cancel()
        if self._client is not None:
            self._watches[new.name] = asyncio.create_task(self._watch(self._client, new))

    def forget(self, name: str) -> Worker | None:
        """A worker leaves: no health checks, no requests (callers drain it first)."""
        worker = self.find(name)
        if worker is None:
            return None
        self.workers.remove(worker)
        watch = self._watches.pop(name, None)
        if watch is not None:
            watch.cancel()
        return worker

    async def run(self, client: httpx.AsyncClient) -> None:
        """Poll forever, each worker on its own schedule (cancel the task to stop)."""
        self._client = client
        for w in self.workers:
            self._watches[w.name] = asyncio.create_task(self._watch(client, w))
        try:
            await asyncio.Event().wait()
        finally:
            self._client = None
            watches, self._watches = list(self._watches.values()), {}
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)

    async def _watch(self, client: httpx.AsyncClient, worker: Worker) -> None:
        while True:  # a busy worker too: its load (queued tokens, free blocks) is only known from this
            await self._check(client, worker)
            await asyncio.sleep(self.next_check_in(worker))
