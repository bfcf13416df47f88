"""Real clusters for integration tests: a shipped config with the tiny model and
free ports, started with `pdserve launch`, stopped by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import yaml

from bench.load.cluster import free_ports  # noqa: F401  (tests import it from here)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def make_config(
    folder: Path, template: str, model: str, changes: dict | None = None, instances: dict[str, dict] | None = None
) -> Path:
    """``configs/<template>.yaml`` with the given model, free ports, one torch thread per server;
    ``changes`` merged into it, ``instances`` (name -> fields) into those instances' entries."""
    data = yaml.safe_load((CONFIGS / f"{template}.yaml").read_text())
    data = merge(
        data,
        {
            "model": model,
            "served_model_name": "tiny",
            "engine": {"num_threads": 1, "kv_cache_bytes": 16 << 20},
            "router": {"health_interval_s": 0.5},
        },
    )
    data = merge(data, changes or {})
    entries = [i for role in ("prefill", "decode", "colocated") for i in data.get(role) or []]
    for entry in entries:
        entry.update((instances or {}).get(entry["name"], {}))
    ports = free_ports(1 + 2 * len(entries))
    data["router"]["port"] = ports[0]
    for i, entry in enumerate(entries):
        entry["port"], entry["kv_port"] = ports[1 + 2 * i], ports[2 + 2 * i]
    path = folder / f"{template}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Cluster:
    def __init__(
        self,
        config: Path,
        run_dir: Path,
        start_timeout: float = 180.0,
        only: str | None = None,
        secret: str | None = None,
    ) -> None:
        self.run_dir = run_dir
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deploy.cli",
                "launch",
                str(config),
                "--run-dir",
                str(run_dir),
                *(["--only", only] if only else []),
            ],
            stdout=open(run_dir / "launcher.log", "wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        manifest = run_dir / "cluster.json"
        deadline = time.monotonic() + start_timeout
        while not manifest.exists():
            if self.launcher.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"cluster did not start:\n{(run_dir / 'launcher.log').read_text()}")
            time.sleep(0.2)
        self.manifest = json.loads(manifest.read_text())
        self.router_url = self.manifest["router_url"]
        self.servers = [p for p in self.manifest["processes"] if p["role"] not in ("router", "front", "planner")]
        # The secret `pdserve launch` generated when the config names none: internal routes need it.
        generated = run_dir / "internal_secret"
        secret = secret or (generated.read_text().strip() if generated.exists() else None)
        self._headers = {"authorization": f"Bearer {secret}"} if secret else {}
        self.http = httpx.Client(timeout=30, headers=self._headers)
        self._clients: dict[tuple, openai.OpenAI] = {}

    def close_connections(self) -> None:
        """Closes the kept-alive connections of this object's clients (the router counts each against
        the address's max_connections_per_client until it closes it, client_keepalive_s later)."""
        self.http.close()
        for client in self._clients.values():
            client.close()
        self.http = httpx.Client(timeout=30, headers=self._headers)
        self._clients = {}

    def client(self, **kw) -> openai.OpenAI:
        """One client per set of options, for the cluster's life: tests reuse its connections instead of
        leaving idle ones open on the router (which keeps them router.client_keepalive_s)."""
        key = tuple(sorted(kw.items()))
        if key not in self._clients:
            self._clients[key] = openai.OpenAI(base_url=f"{self.router_url}/v1", api_key="test", max_retries=0, **kw)
        return self._clients[key]

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.router_url}/v1", api_key="test", max_retries=0)

    def server(self, name: str) -> dict:
        return next(s for s in self.servers if s["name"] == name)

    def blocks(self) -> dict[str, dict]:
        return {s["name"]: self.http.get(f"{s['url']}/health").json()["kv_blocks"] for s in self.servers}

    def wait_idle(self, timeout: float = 3.0) -> float:
        """Seconds until every server holds no reserved or running block; raises after ``timeout``."""
        start = time.monotonic()
        while True:
            blocks = self.blocks()
            if all(b["reserved"] == 0 and b["running"] == 0 for b in blocks.values()):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"blocks still held after {timeout} s: {blocks}")
            time.sleep(0.02)

    def metric(self, name: str, sample: str) -> float:
        """One sample's value from a server's /metrics (0 when absent)."""
        url = self.router_url if name == "router" else self.server(name)["url"]
        for line in self.http.get(f"{url}/metrics").text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        """SIGTERM the launcher (it stops its children); then make sure every pid is gone."""
        if self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
            try:
                self.launcher.wait(30)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait()
        manifest = self.run_dir / "cluster.json"
        pids = [p["pid"] for p in json.loads(manifest.read_text())["processes"]] if manifest.exists() else []
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if hasattr(self, "http"):
            self.http.close()
            for client in self._clients.values():
                client.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


THRESHOLD = 12  # tiny-1p1d as tests/cluster/conftest.py starts it: shorter prompts are prefilled on D
MAX_MODEL_LEN = 1024


def start_cluster(
    tmp_path_factory, template: str, model: str, changes: dict | None = None, instances: dict[str, dict] | None = None
) -> Cluster:
    folder = tmp_path_factory.mktemp(template)
    return Cluster(make_config(folder, template, model, changes, instances), folder)
