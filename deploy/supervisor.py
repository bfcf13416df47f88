"""Supervision under ``pdserve launch``: a process that fails is started again.

Policy (config section ``restart:``, ``deploy.config.RestartConfig``; defaults shown)::

    restart:
      policy: on-failure   # on-failure | never
      backoff_s: 1.0       # wait before the first restart; doubles with each failure in the window
      backoff_max_s: 30.0
      max_restarts: 5      # failures of one process within window_s before the launcher gives up
      window_s: 300.0

A server restarts in the role it recorded last (``RUN_DIR/roles/<name>.json``,
deploy/role_file.py: the role a switch took it to, in the epoch after its last)
and the router joins it again in that role; the launcher's line says which.

A failure is an exit the operator did not ask for: a crash, a kill -9, a
server that ended itself because a thread died (``server_common/vitals.py``).
A server that drained and stopped on someone else's SIGTERM is not one
(``deploy.launcher.Cluster.first_dead``). The rest of the cluster keeps
serving meanwhile; the router takes a restarted server back into rotation
on its first good health check, a restarted decode server is met afresh by
every prefill server (new handshake), a restarted prefill server gets a new
connection identity from every decode server. Each restart is logged, counted
and written to ``RUN_DIR/restarts.json`` (name, exit status, new pid, seconds
until it answered /health again), and ``cluster.json`` is rewritten with the
new pid. Giving up (``policy: never``, or ``max_restarts`` reached) stops the
whole cluster, as a launcher without supervision would.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from deploy.config import RestartConfig
    from deploy.launcher import Cluster, Proc

HEALTH_TIMEOUT_S = 0.5


@dataclass
class Restart:
    """One restart: what failed, when, and how long until it was healthy again."""

    name: str
    role: str
    exit_status: int
    failed_at: float  # time.time()
    pid: int = 0  # the new process; 0 until started
    back_after_s: float | None = None  # failure -> /health answers 200 again


class Supervisor:
    """Called by the launcher's watch loop (``tick``) on one thread."""

    def __init__(
        self,
        cluster: Cluster,
        config: RestartConfig,
        clock: Callable[[], float] = time.monotonic,
        out: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self._cluster = cluster
        self._config = config
        self._clock = clock
        self._out = out
        self._failures: dict[str, list[float]] = {}  # name -> failure times within the window
        self._due: dict[str, tuple[float, Restart, float]] = {}  # name -> (start at, record, failed at monotonic)
        self._starting: dict[str, tuple[Proc, Restart, float]] = {}  # restarted, not healthy yet
        self.restarts: list[Restart] = []
        self._http = httpx.Client(timeout=HEALTH_TIMEOUT_S)

    @property
    def counts(self) -> dict[str, int]:
        """Restarts so far, per process name."""
        out: dict[str, int] = {}
        for r in self.restarts:
            out[r.name] = out.get(r.name, 0) + 1
        return out

    def tick(self) -> Proc | None:
        """Restart what is due, note what came back; the process whose failure stops the cluster, or None."""
        now = self._clock()
        self._start_due(now)
        self._note_back(now)
        dead = self._cluster.first_dead(skip=set(self._due))
        if dead is None:
            return None
        self._starting.pop(dead.name, None)
        code = dead.popen.returncode
        if self._config.policy == "never" or code in (0, -signal.SIGTERM):  # not a failure: someone stopped it
            return dead
        window = [t for t in self._failures.get(dead.name, []) if now - t < self._config.window_s] + [now]
        self._failures[dead.name] = window
        if len(window) > self._config.max_restarts:
            self._out(
                f"pdserve: {dead.role} {dead.name} failed {len(window)} times in {self._config.window_s:g} s; giving up"
            )
            return dead
        delay = min(self._config.backoff_s * 2 ** (len(window) - 1), self._config.backoff_max_s)
        record = Restart(dead.name, dead.role, code, time.time())
        self._due[dead.name] = (now + delay, record, now)
        self._out(
            f"pdserve: {dead.role} {dead.name} exited with status {code}; restarting it in {delay:.1f} s "
            f"(failure {len(window)} of at most {self._config.max_restarts} in {self._config.window_s:g} s). "
            f"Last lines of {dead.log}:\n{dead.log_tail()}"
        )
        return None

    def _start_due(self, now: float) -> None:
        for name, (at, record, failed_at) in list(self._due.items()):
            if now < at:
                continue
            del self._due[name]
            proc = self._cluster.restart(name)
            record.pid = proc.popen.pid
            self.restarts.append(record)
            self._starting[name] = (proc, record, failed_at)
            self._cluster.write_manifest()
            self._write()
            self._out(
                f"pdserve: restarted {record.role} {name} (pid {record.pid}; restart "
                f"{self.counts[name]} of this process)"
            )

    def _note_back(self, now: float) -> None:
        for name, (proc, record, failed_at) in list(self._starting.items()):
            try:
                healthy = self._http.get(f"{proc.url}/health").status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy:
                del self._starting[name]
                record.back_after_s = round(now - failed_at, 3)
                self._write()
                self._out(
                    f"pdserve: {record.role} {name} is healthy again, {record.back_after_s:.1f} s after it failed"
                )

    def _write(self) -> None:
        """Atomically (a reader never sees half a file)."""
        path = self._cluster.run_dir / "restarts.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(
            json.dumps({"counts": self.counts, "restarts": [asdict(r) for r in self.restarts]}, indent=1) + "\n"
        )
        os.replace(tmp, path)

    def close(self) -> None:
        self._http.close()
