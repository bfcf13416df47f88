"""A real cluster whose processes a test may kill and restart one by one.

``pdserve launch`` restarts a failed process on its own schedule
(``deploy/supervisor.py``), so fault tests, which kill and restart servers on
theirs, drive the launcher's own ``Cluster`` from the test process instead:
same commands, same logs under the run dir, every process started, killed
and stopped by its pid, a killed one restarted under its name.
Servers run with ``fault_injection: true`` so the test can arm faults at
``/admin/faults`` (``server_common.faults``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from deploy.config import load_config
from deploy.launcher import Cluster, Proc
from tests.support.cluster import make_config

START_TIMEOUT_S = 180.0


def fault_config(folder: Path, model: str, num_prefill: int, num_decode: int, changes: dict) -> Path:
    """tiny-1p1d with ``num_prefill`` P (NHD, block size 4) and ``num_decode`` D (block size 16; d0 HND,
    d1 NHD), free ports."""
    layout = {
        "prefill": [{"name": f"p{i}", "port": 1, "block_size": 4} for i in range(num_prefill)],
        "decode": [
            {"name": f"d{i}", "port": 1, "block_size": 16, "kv_layout": "NHD" if i % 2 else "HND"}
            for i in range(num_decode)
        ],
    }
    return make_config(folder, "tiny-1p1d", model, {**layout, "fault_injection": True, **changes})


class FaultCluster:
    def __init__(self, config: Path, run_dir: Path) -> None:
        self.cluster = Cluster(config, load_config(config), run_dir)
        self._stop = threading.Event()
        try:
            self.cluster.wait_healthy(self.cluster.start_servers(), START_TIMEOUT_S, self._stop)
            self.cluster.wait_healthy(self.cluster.start_routers(), START_TIMEOUT_S, self._stop)
        except BaseException:
            self.stop()
            raise
        self.router_url = self.cluster.cluster.router_url
        self.lease_s = self.cluster.cluster.lease_s
        self.prefill = [i.name for i in self.cluster.cluster.prefill]
        self.decode = [i.name for i in self.cluster.cluster.decode]
        self.http = httpx.Client(timeout=10)

    # ---- processes ------------------------------------------------------------------
    def proc(self, name: str) -> Proc:
        return next(p for p in self.cluster.procs if p.name == name)

    def alive(self, name: str) -> bool:
        return self.proc(name).popen.poll() is None

    def servers(self) -> list[str]:
        return [*self.prefill, *self.decode]

    def kill(self, name: str) -> None:
        """kill -9, by pid."""
        proc = self.proc(name)
        os.kill(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)

    def restart(self, name: str) -> None:
        """Start a killed server again (returns at once; see ``wait_back``)."""
        self.cluster.restart(name)

    def wait_back(self, names: list[str], timeout: float = 60.0) -> None:
        """Until the restarted servers answer /health and the router has them in rotation again."""
        self.cluster.wait_healthy([self.proc(n) for n in names], timeout, self._stop)
        deadline = time.monotonic() + timeout
        while True:
            workers = self.http.get(f"{self.router_url}/health").json()["workers"]
            if all(w["healthy"] for w in workers):
                return
            assert time.monotonic() < deadline, f"router still has workers out: {workers}"
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM every process by pid, SIGKILL after the launcher's grace period."""
        self.cluster.stop_all()
        if hasattr(self, "http"):
            self.http.close()

    # ---- state ------------------------------------------------------------------------
    def url(self, name: str) -> str:
        return self.router_url if name == "router" else self.proc(name).url

    def blocks(self) -> dict[str, dict]:
        """kv_blocks of every live server (free, reserved, running, total)."""
        return {n: self.http.get(f"{self.url(n)}/health").json()["kv_blocks"] for n in self.servers() if self.alive(n)}

    def leaked_blocks(self, timeout: float) -> tuple[int, dict]:
        """Wait until every live server holds nothing; then (blocks still held, the last view)."""
        deadline = time.monotonic() + timeout
        while True:
            blocks = self.blocks()
            held = sum(
                b["reserved"] + b["running"] + (b["total"] - b["free"] - b["reserved"] - b["running"])
                for b in blocks.values()
            )
            if held == 0 and all(b["free"] == b["total"] for b in blocks.values()):
                return 0, blocks
            if time.monotonic() > deadline:
                return sum(b["total"] - b["free"] for b in blocks.values()), blocks
            time.sleep(0.05)

    def metric(self, name: str, sample: str) -> float:
        for line in self.http.get(f"{self.url(name)}/metrics").text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return 0.0

    # ---- fault injection ---------------------------------------------------------------
    def arm(self, name: str, **plan) -> dict:
        resp = self.http.post(f"{self.url(name)}/admin/faults", json=plan)
        resp.raise_for_status()
        return resp.json()

    def release(self, name: str) -> None:
        self.http.post(f"{self.url(name)}/admin/faults/release").raise_for_status()

    def faults(self, name: str) -> dict:
        return self.http.get(f"{self.url(name)}/admin/faults").json()

    def disarm_all(self) -> None:
        for name in self.servers():
            if self.alive(name):
                self.arm(name)
