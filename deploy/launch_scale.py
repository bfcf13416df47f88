"""`pdserve launch`'s side of a pool that grows: it starts and stops added instances as the planner asks.

With ``planner.mode: act`` and ``planner.max_instances`` the planner
(deploy/planner.py) may want one instance more or fewer than the pool has.
The planner owns no process; the launcher does, so the launcher asks: every
``planner.interval_s`` ``PoolScaler`` reads the planner's ``GET /wanted``
(deploy/planner_loop.py: the pool's size per role, the change and its role,
a sequence number; the answer must carry this launch's id), and carries out
each new ask once:

* **start**: a new instance of the asked role, named ``added-K``, on the
  first free port pair above the cluster's own ports (its HTTP port and,
  next to it, its KV port). It gets a config of its own,
  ``RUN_DIR/added/added-K.yaml``: the cluster's file with it listed in its
  role, so the server starts as the listed ones do (same command, launch id,
  role file, OpenMP environment), and a restart by the supervisor uses that
  file too. Once it answers ``/health`` the launcher has every router
  discover it (``POST /admin/workers``, the internal secret): a decode
  server is announced to the prefill servers, a prefill server told every
  decode server, as any joining worker.
* **stop**: an added instance now in the asked role (its role file says;
  else the newest added one). Every router lets it leave
  (``DELETE /admin/workers/NAME``: out of rotation, a decode server's streams
  migrate to the others, its requests finish, then it is forgotten and, a
  decode server, forgotten by the prefill servers), and then the launcher
  stops it by its pid: SIGTERM, which drains what is left, and SIGKILL
  after ``drain_timeout_s`` plus a grace period.

Listed instances are never stopped: they are the pool's floor, and
``max_instances`` its ceiling. A router that restarts knows only the listed
instances, so every interval the launcher also has each router discover the
added instances it does not list.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import yaml

from deploy.launcher import GRACE_S, LaunchError, Proc, routes_here
from deploy.ports import bind_error, ports_of

if TYPE_CHECKING:
    from deploy.launcher import Cluster

log = logging.getLogger("pdserve.launch")
ADDED_PREFIX = "added-"


def start_pool_scaler(c: Cluster, health_timeout_s: float) -> Callable[[], None]:
    """``launch``'s ``on_up``: the scaler's thread where the planner acts on a pool that may grow and runs on
    this host; what stops it."""
    planner = c.cluster.planner
    if planner.mode != "act" or planner.max_instances is None or not routes_here(c.only):
        return lambda: None
    scaler = PoolScaler(c, health_timeout_s)
    scaler.start()
    print(f"pdserve: the pool may grow to {planner.max_instances} instances as the planner asks", flush=True)
    return scaler.close


class PoolScaler(threading.Thread):
    """Polls the planner's ``/wanted`` and starts or stops one added instance per new ask (module docstring)."""

    def __init__(self, c: Cluster, health_timeout_s: float = 600.0) -> None:
        super().__init__(name="pool-scaler", daemon=True)
        self.c = c
        planner = c.cluster.planner
        assert planner.max_instances is not None
        self.max_instances = planner.max_instances
        self.interval_s = planner.interval_s
        self.health_timeout_s = health_timeout_s
        self.planner_url = f"http://{c.cluster.router_host}:{planner.port}"
        replicas = c.cluster.router.replicas
        self.router_urls = (
            [c.cluster.router_replica_url(k) for k in range(replicas)] if replicas > 1 else [c.cluster.router_url]
        )
        secret = c.cluster.security.secret()
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self._http = httpx.Client(timeout=c.cluster.drain_timeout_s + 30.0, headers=headers)
        self._quit = threading.Event()
        self._done_seq = 0
        self.added: list[Proc] = []  # running, oldest first
        self._count = 0

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self) -> None:
        while not self._quit.wait(self.interval_s):
            try:
                self.tick()
            except KeyboardInterrupt:  # closed while an instance was starting
                return
            except (httpx.HTTPError, LaunchError, OSError, ValueError) as exc:
                log.warning("pool scaler: %s", exc)
                print(f"pdserve: pool scaler: {exc}", flush=True)

    def close(self) -> None:
        """Stop polling; an instance being started is left to the launcher's shutdown, which stops every one."""
        self._quit.set()
        self.join(timeout=5.0)
        self._http.close()

    def tick(self) -> None:
        """One poll: carry out a new ask, and make sure every router knows every added instance."""
        self.added = [p for p in self.added if p in self.c.procs]  # the supervisor may have replaced one
        self.added += [
            p for p in self.c.procs if p.name.startswith(ADDED_PREFIX) and p not in self.added and p.role != "router"
        ]
        self._rejoin()
        wanted = self.wanted()
        if wanted is None or wanted["seq"] <= self._done_seq:
            return
        self._done_seq = wanted["seq"]
        running = self.listed + len(self.added)
        total = int(wanted["prefill"]) + int(wanted["decode"])
        if wanted["change"] == "start" and running < min(total, self.max_instances):
            self.start_instance(wanted["role"])
        elif wanted["change"] == "stop" and running > total and self.added:
            self.stop_instance(wanted["role"])

    @property
    def listed(self) -> int:
        return len(self.c.cluster.prefill) + len(self.c.cluster.decode)

    def wanted(self) -> dict | None:
        """The planner's latest ask, or None (none yet, or an answer from a process of another launch)."""
        body = self._http.get(f"{self.planner_url}/wanted", timeout=5.0).json()
        if body.get("launch_id") != self.c.launch_id:
            raise LaunchError(f"{self.planner_url}/wanted is answered by another launch's planner")
        return body.get("wanted")

    # ---- starting ---------------------------------------------------------------------------------------
    def start_instance(self, role: str) -> Proc:
        """A new ``role`` server, healthy and discovered by every router."""
        name = self._new_name()
        port = self._free_pair()
        config = self._config_of(name, role, port)
        self.c.configs[name] = config
        url = f"http://{self.c.cluster.host}:{port}"
        print(f"pdserve: starting {role} {name} on port {port}: the planner asked for one more", flush=True)
        proc = self.c._spawn(role, name, url, self.c.server_args(role, name))
        self.added.append(proc)
        self.c.write_manifest()
        try:
            self.c.wait_healthy([proc], self.health_timeout_s, self._quit)
            for router in self.router_urls:
                self._join(router, url)
        except LaunchError:
            self._end(proc)  # a start that failed is no instance of the pool
            raise
        print(f"pdserve: {role} {name} joined the routers", flush=True)
        return proc

    def _new_name(self) -> str:
        taken = {p.name for p in self.c.procs} | {i.name for i in self.c.cluster.instances()}
        while True:
            self._count += 1
            name = f"{ADDED_PREFIX}{self._count}"
            if name not in taken:
                return name

    def _free_pair(self) -> int:
        """The first port p above every port of the cluster with p and p + 1 free on the servers' bind host and
        neither the cluster's nor an added instance's."""
        cluster = self.c.cluster
        used = {u.port for u in ports_of(cluster)} | {cluster.planner.port}
        used |= {i.transfer_port for i in cluster.instances()}
        for proc in self.added:
            port = int(proc.url.rsplit(":", 1)[1])
            used |= {port, port + 1}
        host = cluster.bind_host_of(cluster.instances()[0])
        port = max(used) + 1
        while port + 1 <= 65535:
            if not {port, port + 1} & used and bind_error(host, port) is None and bind_error(host, port + 1) is None:
                return port
            port += 1
        raise LaunchError(f"no free port pair on {host} above {max(used)}")

    def _config_of(self, name: str, role: str, port: int) -> Path:
        """The cluster's config with instance ``name`` listed as a ``role`` server."""
        data = yaml.safe_load(self.c.config_path.read_text())
        data[role] = [*data.get(role, []), {"name": name, "port": port, "kv_port": port + 1}]
        folder = self.c.run_dir / "added"
        folder.mkdir(exist_ok=True)
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def _join(self, router: str, url: str) -> None:
        r = self._http.post(f"{router}/admin/workers", json={"url": url})
        if r.status_code != 200:
            raise LaunchError(f"{router} did not take {url}: {r.status_code} {r.text[:300]}")

    def _rejoin(self) -> None:
        """Each router discovers the running added instances it does not list (it restarted meanwhile)."""
        if not self.added:
            return
        for router in self.router_urls:
            try:
                known = {w["name"] for w in self._http.get(f"{router}/admin/workers", timeout=5.0).json()["workers"]}
            except (httpx.HTTPError, ValueError, KeyError):
                continue  # down or restarting: the next interval asks again
            for proc in self.added:
                if proc.name not in known and proc.popen.poll() is None and self._answers(proc):
                    self._join(router, proc.url)

    def _answers(self, proc: Proc) -> bool:
        try:
            return self._http.get(f"{proc.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    # ---- stopping ---------------------------------------------------------------------------------------
    def stop_instance(self, role: str) -> Proc:
        """An added instance in ``role`` (else the newest): it leaves every router, then stops by its pid."""
        now = {p.name: self.c.last_role(p.name) or p.role for p in self.added}
        proc = next((p for p in reversed(self.added) if now[p.name] == role), self.added[-1])
        print(f"pdserve: stopping {now[proc.name]} {proc.name}: the planner asked for one fewer", flush=True)
        for router in self.router_urls:
            r = self._http.delete(f"{router}/admin/workers/{proc.name}")
            if r.status_code not in (200, 404):  # 404: that router had not discovered it
                raise LaunchError(f"{router} did not let {proc.name} leave: {r.status_code} {r.text[:300]}")
        self._end(proc)
        print(f"pdserve: {proc.name} stopped (status {proc.popen.returncode})", flush=True)
        return proc

    def _end(self, proc: Proc) -> None:
        """Stop ``proc`` by its pid (SIGTERM, SIGKILL after the drain timeout and grace), out of the launcher's
        processes first so that the supervisor does not start it again."""
        self.c.procs = [p for p in self.c.procs if p is not proc]
        if proc in self.added:
            self.added.remove(proc)
        proc.popen.terminate()
        try:
            proc.popen.wait(self.c.cluster.drain_timeout_s + GRACE_S)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()
        self.c.write_manifest()
