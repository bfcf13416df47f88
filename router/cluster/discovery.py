"""Workers joining and leaving at runtime, without a router restart.

Three sources, one path: the config's instances (``static``, added at start),
DNS names re-resolved every ``interval_s`` (``dns``: a Kubernetes headless
Service resolves to one address per ready pod), and the admin API
(``POST /admin/workers {"url"}``, ``DELETE /admin/workers/{name}``).

Joining: the worker is asked for its ``/health``: its role, instance name and
model (``server_common.model_id``). Another model, a name already in use or
an answer that is no health report is refused (a log line and
``pdserve_router_workers_refused{reason}``). A decode server that joins is
announced to every prefill server (``POST /admin/peers``: only then may they
hand it KV); a prefill server that joins is told every decode server. The
worker is routed to once its health checks pass.

Leaving: the worker is drained (no new request goes to it; its requests in
flight finish, at most ``drain_timeout_s`` seconds), then forgotten; a decode
server that left is forgotten by every prefill server too
(``DELETE /admin/peers/{name}``), which releases what the transfer layer
held for it (NIXL remote agent and descriptor lists, ZeroMQ socket), so a
replacement at the same name or address is met afresh and churn does not
grow memory.

Switching a worker's role in place (``switch_role``, the admin API's
``POST /admin/workers/{name}/role``): the worker leaves rotation and its
requests finish or move (as a leave), a decode server is forgotten by every
prefill server, the worker's own ``POST /admin/role`` switches it
(deploy/role_server.py: it drains, keeps its engine, bumps its role epoch),
and it is discovered again from its ``/health`` as a worker of its new role:
a new decode server is announced to the prefill servers, a new prefill
server is told every decode server. One switch at a time; none that would
leave no prefill or no decode server in rotation.

Joining again (``readmit``, told by the registry's health checks): a known
worker whose ``/health`` reports another role or another role epoch than
this router's view (a process restarted by ``pdserve launch`` in the role it
was last switched to, in a new epoch, deploy/role_file.py; a pod restarted in
its configured role; a switch made at the server itself or through another
router replica), or one lost during a switch that answers again, is out of
rotation at once and joins again as it reports itself (the new view takes
the old one's place in one step: the name stays known), as a switch's end
does: a decode server it was is forgotten by the prefill servers, a decode
server it is now is announced to them, a prefill server it is now is told
every decode server. It is never routed to under the view it left. This
counts as the one change at a time: while another worker switches it waits
for a later health check.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial

import httpx

from router.cluster.registry import Worker, WorkerRegistry
from router.metrics import JoinRefusal, RouterMetrics
from router.settings import DiscoverySettings, WorkerRole
from wire.names import INSTANCE_NAME, is_instance_name

log = logging.getLogger(__name__)
ROLES: dict[str, WorkerRole] = {"prefill": "prefill", "decode": "decode", "colocated": "decode"}
Resolve = Callable[[str], Awaitable[list[str]]]  # host -> its addresses now


SWITCH_ROLES = ("prefill", "decode", "colocated")
SWITCH_CALL_MARGIN_S = 30.0  # the worker's own drain is bounded by its drain_timeout_s; this on top


class SwitchRefused(Exception):
    """A role switch refused or failed: ``status`` (400, 404, 409, 502) and ``reason`` (the error code)."""

    def __init__(self, status: int, reason: str, why: str) -> None:
        super().__init__(why)
        self.status, self.reason = status, reason


class JoinRefused(Exception):
    def __init__(self, url: str, reason: str, why: str) -> None:
        super().__init__(f"worker at {url} refused: {why}")
        self.reason = reason  # the metric label


async def resolve_host(host: str) -> list[str]:
    """Every IPv4/IPv6 address ``host`` resolves to now (empty when it does not resolve)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    addresses = (info[4][0] for info in infos)
    return sorted({a for a in addresses if isinstance(a, str)})  # (not the (int, bytes) of a Python without IPv6)


def url_of(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class Discovery:
    def __init__(
        self,
        registry: WorkerRegistry,
        http: httpx.AsyncClient,
        settings: DiscoverySettings,
        model_id: str,
        metrics: RouterMetrics,
        drain_timeout_s: float,
        resolve: Resolve = resolve_host,
    ) -> None:
        self._registry = registry
        self._http = http
        self._settings = settings
        self._model_id = model_id
        self._metrics = metrics
        self._drain_timeout_s = drain_timeout_s
        self._resolve = resolve
        self._leaving: dict[str, asyncio.Task] = {}
        self.found: dict[str, str] = {}  # url -> worker name, of the workers DNS found
        self.switching: str | None = None  # the worker whose role is being switched or rejoined (one at a time)
        self._readmits: set[asyncio.Task] = set()
        registry.on_changed = self.readmit

    # ---- joining ------------------------------------------------------------------------
    async def join(self, url: str, like: Worker | None = None) -> Worker:
        """Ask the worker at ``url`` who it is and add it; raises ``JoinRefused``. ``like``: the worker it
        was before a role switch, whose in-flight limit and origin it keeps."""
        url = url.rstrip("/")
        try:
            report = (await self._http.get(f"{url}/health", timeout=5.0)).json()
            name, role, model = report["instance"], ROLES[report["role"]], report.get("model", "")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise self._refused(url, "no_health_report", f"no health report ({exc!r})") from None
        if not is_instance_name(name):
            raise self._refused(url, "bad_name", f"its instance name {str(name)[:80]!r} does not match {INSTANCE_NAME}")
        if model != self._model_id:
            raise self._refused(url, "other_model", f"it serves model {model!r}, this router {self._model_id!r}")
        known = self._registry.find(name)
        if known is not None and known is not like:
            if known.url == url:
                return known
            raise self._refused(url, "name_in_use", f"worker name {name!r} is in use by {known.url}")
        worker = Worker(name, role, url, max_inflight=self._settings.max_inflight, discovered=True)
        if like is not None:
            worker.max_inflight, worker.discovered = like.max_inflight, like.discovered
            worker.apply_health(report)  # its role epoch, sent with its calls from the first one
        if role == "decode":
            await self._tell_prefills("POST", "/admin/peers", {"name": name, "url": url}, besides=known)
        else:
            await asyncio.gather(
                *(
                    self._peer_call(worker, "POST", "/admin/peers", {"name": d.name, "url": d.url})
                    for d in self._registry.of_role("decode")
                    if d is not known
                )
            )
        if known is not None:  # ``like``, joined again: in its place at once
            self._registry.replace(known, worker)
        else:
            if like is not None:  # another instance answers at its address now
                self._registry.forget(like.name)
            self._registry.add(worker)
        self._metrics.workers_joined.inc()
        log.info("worker %s (%s, %s) joined", name, role, url)
        return worker

    def _refused(self, url: str, reason: JoinRefusal, why: str) -> JoinRefused:
        self._metrics.workers_refused.labels(reason=reason).inc()
        log.warning("worker at %s refused: %s", url, why)
        return JoinRefused(url, reason, why)

    # ---- leaving ------------------------------------------------------------------------
    async def leave(self, name: str) -> Worker | None:
        """Drain the worker, then forget it (and, for a decode server, so do the prefill servers)."""
        worker = self._registry.find(name)
        if worker is None:
            return None
        await self._registry.drain(worker, self._drain_timeout_s)
        self._registry.forget(name)
        if worker.role == "decode":
            await self._tell_prefills("DELETE", f"/admin/peers/{name}")
        self._metrics.workers_left.inc()
        log.info("worker %s (%s) left", name, worker.url)
        return worker

    # ---- switching a role ---------------------------------------------------------------
    async def switch_role(self, name: str, role: str, move_off: Callable[[str], int] | None = None) -> dict:
        """Switch worker ``name`` to ``role`` in place (see the module); its new description's fields
        and the seconds it took. ``move_off(name)`` migrates a decode server's streams (None: they
        finish there). Raises ``SwitchRefused``."""
        if role not in SWITCH_ROLES:
            raise SwitchRefused(400, "unknown_role", f"unknown role {role[:32]!r}: one of {list(SWITCH_ROLES)}")
        worker = self._registry.find(name)
        if worker is None:
            raise SwitchRefused(404, "unknown_worker", f"no worker named {name!r}")
        if self.switching is not None:
            raise SwitchRefused(409, "switch_in_progress", f"worker {self.switching!r} is switching role now")
        if ROLES[role] != worker.role:
            others = [w for w in self._registry.healthy(worker.role) if w is not worker]
            if not others:
                why = f"it is the last {worker.role} server in rotation: the cluster would have none"
                raise SwitchRefused(409, f"no_{worker.role}_left", why)
        self.switching = name
        try:
            return await self._switch(worker, role, move_off)
        finally:
            self.switching = None

    async def _switch(self, worker: Worker, role: str, move_off: Callable[[str], int] | None) -> dict:
        started = time.monotonic()
        worker.set_draining(True)  # out of rotation first: nothing migrates back onto it
        if move_off is not None:
            move_off(worker.name)
        await self._registry.drain(worker, self._drain_timeout_s)
        if worker.role == "decode":
            await self._tell_prefills("DELETE", f"/admin/peers/{worker.name}")
        try:
            resp = await self._http.post(
                f"{worker.url}/admin/role", json={"role": role}, timeout=self._drain_timeout_s + SWITCH_CALL_MARGIN_S
            )
            answer = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            answer, resp = {"error": repr(exc), "code": "unreachable"}, None
        # Whatever it answered, it is discovered again as it reports itself now (a failed switch left
        # it in its old role, or in its configured one if it died and was started again).
        rejoined = await self._rejoin(worker)
        if resp is None or resp.status_code != 200:
            status = resp.status_code if resp is not None and resp.status_code in (400, 409) else 502
            why = f"worker {worker.name!r} did not switch: {str(answer.get('error', answer))[:300]}"
            raise SwitchRefused(status, str(answer.get("code", "switch_failed"))[:40], why)
        if rejoined is None:
            raise SwitchRefused(502, "rejoin_failed", f"worker {worker.name!r} switched but did not join again")
        seconds = time.monotonic() - started
        log.info("worker %s switched to %s (role epoch %s) in %.2f s", worker.name, role, rejoined.role_epoch, seconds)
        return {"worker": rejoined, "seconds": seconds, "server_seconds": answer.get("seconds")}

    def readmit(self, worker: Worker) -> None:
        """``worker`` reports another role or epoch (see the module; the registry took it out): join it
        again as it reports itself, unless a switch or leave is under way (a later check asks again)."""
        if self.switching is not None or worker.name in self._leaving or self._registry.find(worker.name) is not worker:
            return
        self.switching = worker.name
        task = asyncio.create_task(self._readmit(worker))
        self._readmits.add(task)
        task.add_done_callback(self._readmits.discard)

    async def _readmit(self, worker: Worker) -> None:
        drained = worker.draining and not worker.rejoin  # drained through the admin API: it stays drained
        try:
            if worker.role == "decode":  # as a switch does: the prefill servers meet what it is now afresh
                await self._tell_prefills("DELETE", f"/admin/peers/{worker.name}")
            rejoined = await self._rejoin(worker)
            if rejoined is not None:
                rejoined.set_draining(drained)
                log.info("worker %s joined again: %s, role epoch %s", worker.name, rejoined.role, rejoined.role_epoch)
        finally:
            self.switching = None

    async def _rejoin(self, worker: Worker) -> Worker | None:
        """Discover ``worker`` again at its address (its role and epoch as it reports them now), in its
        place in the registry; back in rotation once its health checks pass. None (and it stays known,
        out of rotation, until it answers and joins again: ``readmit``) when it does not answer as a
        worker of this cluster."""
        try:
            return await self.join(worker.url, like=worker)
        except JoinRefused as exc:
            log.warning("worker %s did not join again after its role switch: %s", worker.name, exc)
            worker.lost_in_switch()  # joined again once it answers (``readmit``)
            if self._registry.find(worker.name) is None:
                self._registry.add(worker)
            return None

    # ---- DNS ------------------------------------------------------------------------
    async def run(self) -> None:
        """With ``dns``: resolve every name each ``interval_s``; new addresses join, gone ones leave."""
        if self._settings.kind != "dns":
            return
        while True:
            await self.resolve_once()
            await asyncio.sleep(self._settings.interval_s)

    async def resolve_once(self) -> None:
        urls: set[str] = set()
        for entry in self._settings.names:
            host, _, port = entry.rpartition(":")
            urls.update(url_of(a, int(port)) for a in await self._resolve(host))
        for url in sorted(urls - set(self.found)):
            try:
                self.found[url] = (await self.join(url)).name
            except JoinRefused:
                pass  # tried again next round: a pod that is not ready yet answers later
        for url in sorted(set(self.found) - urls):
            name = self.found.pop(url)
            if name not in self._leaving:
                task = asyncio.create_task(self.leave(name))
                self._leaving[name] = task
                task.add_done_callback(partial(self._left, name))

    def _left(self, name: str, _: asyncio.Task) -> None:
        """``name``'s leave ended: a later one may start."""
        self._leaving.pop(name, None)

    # ---- helpers ------------------------------------------------------------------------
    async def _tell_prefills(
        self, method: str, path: str, body: dict | None = None, besides: Worker | None = None
    ) -> None:
        """Every prefill server but ``besides`` (a worker joining again, as what it was)."""
        prefills = [p for p in self._registry.of_role("prefill") if p is not besides]
        await asyncio.gather(*(self._peer_call(p, method, path, body) for p in prefills))

    async def _peer_call(self, worker: Worker, method: str, path: str, body: dict | None) -> None:
        """Best effort: a prefill server that misses it learns a joined decode server when it joins
        again, and refuses reservations of one it does not know (the router then retries elsewhere)."""
        try:
            resp = await self._http.request(method, f"{worker.url}{path}", json=body, timeout=5.0)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("%s %s on %s failed: %r", method, path, worker.name, exc)
