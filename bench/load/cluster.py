"""Start a cluster with ``pdserve launch`` on chosen cores, and stop it by pid.

The launcher runs with its CPU affinity set to ``cores`` before exec, and
every server and the router it spawns inherit that affinity, so the
colocated baseline and an xPyD layout get exactly the same cores. Torch
thread counts come from each config.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STOP_GRACE_S = 20.0


class ClusterError(RuntimeError):
    """The cluster did not come up; the message says which process and where its log is."""


LISTEN_FLOOR = 10000  # servers' ports are picked from here up to the ephemeral range (below: well-known services)


def ephemeral_range() -> tuple[int, int]:
    """The ports this host gives outgoing connections their local end from (Linux's ``ip_local_port_range``)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _free_run(width: int, host: str, taken: set[int]) -> int:
    """A port p with p .. p + width - 1 free on ``host`` now and none of them in ``taken``, drawn at random
    below the ephemeral range. A port picked there stays free until its server binds it: one in the
    ephemeral range can meanwhile become an outgoing connection's local end (a server binding it then fails
    with "address already in use", and a decode server's KV port is bound only while it decodes). Drawn at
    random so that processes picking at the same time rarely draw the same port."""
    top = ephemeral_range()[0] - width
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(LISTEN_FLOOR, top) if top > LISTEN_FLOOR else _any_free(host)
        run = range(port, port + width)
        if port + width - 1 > 65535 or taken.intersection(run):
            continue
        try:
            for q in run:
                with socket.socket() as s:
                    s.bind((host, q))
        except OSError:
            continue
        return port
    raise ClusterError(f"could not find {width} free consecutive port(s) on {host}")


def _any_free(host: str) -> int:
    """A port the kernel finds free on ``host`` (where the ephemeral range leaves nothing below it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, below the ephemeral range (``_free_run``)."""
    found: list[int] = []
    for _ in range(n):
        found.append(_free_run(1, host, set(found)))
    return found


def free_port_pairs(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports p with p and p + 1 free (a server's HTTP port and its KV port), below the ephemeral range."""
    found: list[int] = []
    for _ in range(count):
        found.append(_free_run(2, host, {q for p in found for q in (p, p + 1)}))
    return found


def cpu_list(text: str | None) -> list[int]:
    """``0,1`` or ``0-3`` (default: the cores this process may use)."""
    if not text:
        return sorted(os.sched_getaffinity(0))
    cores: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise ValueError(f"bad CPU list {text!r}: use 0,1 or 0-3")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        cores.update(range(lo, hi + 1))
    allowed = os.sched_getaffinity(0)
    if not cores <= allowed:
        raise ValueError(f"CPU list {text!r} names cores this process may not use (allowed: {sorted(allowed)})")
    return sorted(cores)


@dataclass
class RunningCluster:
    """A launched cluster: its launcher process and ``cluster.json``."""

    launcher: subprocess.Popen
    run_dir: Path
    manifest: dict

    @property
    def url(self) -> str:
        return self.manifest["router_url"]

    @property
    def model(self) -> str:
        return self.manifest["model"]

    def processes(self, role: str | None = None) -> list[dict]:
        return [p for p in self.manifest["processes"] if role is None or p["role"] == role]

    def samples(self, prefix: str = "pdserve_") -> dict[str, dict[str, float]]:
        """Every Prometheus sample starting with ``prefix``, per server name:
        ``{"d0": {'pdserve_engine_steps_total{kind="decode"}': 812.0, ...}}``."""
        out: dict[str, dict[str, float]] = {}
        with httpx.Client(timeout=5.0) as client:
            for proc in self.processes():
                if proc["role"] == "router":
                    continue
                try:
                    text = client.get(proc["url"] + "/metrics").text
                except httpx.HTTPError:
                    continue
                values = out.setdefault(proc["name"], {})
                for line in text.splitlines():
                    if line.startswith(prefix):
                        key, _, value = line.rpartition(" ")
                        try:
                            values[key] = float(value)
                        except ValueError:
                            pass
        return out

    def stop(self) -> list[int]:
        """SIGTERM the launcher (it stops everything); then SIGKILL any pid left.

        Returns the pids that had to be killed (empty when shutdown was clean).
        """
        if self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
            try:
                self.launcher.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait()
        killed = []
        for proc in self.processes():
            if _alive(proc["pid"]):
                os.kill(proc["pid"], signal.SIGKILL)
                killed.append(proc["pid"])
        return killed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of someone else still answers kill(0); check its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def launch(
    config: Path, run_dir: Path, cores: list[int], timeout: float = 600.0, cwd: Path | None = None
) -> RunningCluster:
    """Runs ``pdserve launch CONFIG --run-dir RUN_DIR`` pinned to ``cores``; ``cwd``: the checkout whose
    pdserve runs it (default: the one this process imports)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = run_dir / "cluster.json"
    manifest_path.unlink(missing_ok=True)
    log = open(run_dir / "launcher.log", "ab")
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "launch",
        str(config),
        "--run-dir",
        str(run_dir),
        "--health-timeout",
        str(timeout),
    ]
    launcher = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
        cwd=cwd,
        env=None if cwd is None else {**os.environ, "PYTHONPATH": str(cwd)},
    )
    log.close()
    manifest: dict = {"processes": []}
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if launcher.poll() is not None:
                tail = (run_dir / "launcher.log").read_text(errors="replace").splitlines()[-20:]
                raise ClusterError(f"pdserve launch {config} exited with {launcher.returncode}:\n" + "\n".join(tail))
            if manifest_path.is_file():
                try:
                    manifest = json.loads(manifest_path.read_text())
                except json.JSONDecodeError:
                    pass  # being written
                else:
                    if _healthy(manifest["router_url"]):
                        return RunningCluster(launcher, run_dir, manifest)
            time.sleep(0.3)
        raise ClusterError(f"pdserve launch {config} not ready after {timeout:.0f} s (logs in {run_dir})")
    except BaseException:
        RunningCluster(launcher, run_dir, manifest).stop()
        raise


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
