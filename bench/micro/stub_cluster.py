"""A 1P1D cluster of stub servers (bench/micro/stubs.py) behind the real router.

Three processes on 127.0.0.1: a prefill stub, a decode stub and
``pdserve router`` reading a cluster YAML written here, with a byte-level
tokenizer folder as its model. Used by ``pdserve bench router``
(bench/micro/router_bench.py) and by the router's load tests; every process is
stopped by its pid in ``stop``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import free_ports
from bench.micro.stubs import make_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]


class StubCluster:
    """``router`` (dict) is merged into the config's router section; ``token_delay`` and
    ``health_delay`` and ``keep_alive`` (s) go to both stubs (see bench/micro/stubs.py); ``router_pythonpath``
    goes first on the router's PYTHONPATH."""

    def __init__(
        self,
        folder: Path,
        *,
        router: dict | None = None,
        token_delay: float = 0.0,
        health_delay: float = 0.0,
        model: Path | None = None,
        log_level: str = "warning",
        router_pythonpath: str | None = None,
        keep_alive: float = 5.0,
        start_timeout: float = 60.0,
    ) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        model = model or make_byte_tokenizer(folder / "model", max_position_embeddings=4096)
        router_port, p_port, p_kv, d_port, d_kv = free_ports(5)
        config = {
            "model": str(model),
            "served_model_name": "stub",
            "max_model_len": 4096,
            "router": {"port": router_port, "health_interval_s": 0.5, **(router or {})},
            "transfer": {"backend": "zmq"},
            "prefill": [{"name": "p0", "port": p_port, "kv_port": p_kv}],
            "decode": [{"name": "d0", "port": d_port, "kv_port": d_kv}],
        }
        self.config = folder / "cluster.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.router_url = f"http://127.0.0.1:{router_port}"
        self.prefill_url = f"http://127.0.0.1:{p_port}"
        self.decode_url = f"http://127.0.0.1:{d_port}"
        self.procs: dict[str, subprocess.Popen] = {}
        env = dict(os.environ, PYTHONPATH=str(REPO))
        stub_args = [
            "--token-delay",
            str(token_delay),
            "--health-delay",
            str(health_delay),
            "--keep-alive",
            str(keep_alive),
        ]
        try:
            peer = ["--decode-peer", f"d0={self.decode_url}"]
            for name, role, port, extra in (("p0", "prefill", p_port, peer), ("d0", "decode", d_port, [])):
                argv = [sys.executable, "-m", "bench.micro.stubs", role, "--port", str(port), "--name", name]
                self._start(name, [*argv, *stub_args, *extra], env)
            self._wait_ok(f"{self.prefill_url}/stub/stats", start_timeout)
            self._wait_ok(f"{self.decode_url}/stub/stats", start_timeout)
            router_env = (
                dict(env, PYTHONPATH=os.pathsep.join([router_pythonpath, str(REPO)])) if router_pythonpath else env
            )
            self._start_router("router", self.config, self.router_url, router_env, REPO, log_level, start_timeout)
        except BaseException:
            self.stop()
            raise

    def add_router(self, name: str, repo: Path, log_level: str = "warning", start_timeout: float = 60.0) -> str:
        """A second router in front of the same stubs, run from the checkout ``repo`` (its code, this
        cluster's config on a port of its own); returns its URL. Stopped with the others, by pid."""
        config = yaml.safe_load(self.config.read_text())
        port = free_ports(1)[0]
        config["router"]["port"] = port
        path = self.folder / f"cluster-{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        url = f"http://127.0.0.1:{port}"
        self._start_router(name, path, url, dict(os.environ, PYTHONPATH=str(repo)), repo, log_level, start_timeout)
        return url

    def add_replicas(self, replicas: int, log_level: str = "warning", start_timeout: float = 60.0) -> str:
        """``replicas`` routers (``router.replicas``, each its own part of the stubs' limits) and HAProxy in
        front of them, as `pdserve launch` starts them (deploy/front.py), before the same stubs; returns the
        front's URL. The processes are ``replica-K`` and ``haproxy``, stopped with the others, by pid."""
        from deploy.config import load_config
        from deploy.front import haproxy_binary, haproxy_config

        config = yaml.safe_load(self.config.read_text())
        front, *ports = free_ports(1 + replicas)
        config["router"].update(port=front, replicas=replicas, replica_ports=ports)
        path = self.folder / "cluster-replicas.yaml"
        path.write_text(yaml.safe_dump(config))
        env = dict(os.environ, PYTHONPATH=str(REPO))
        for k in range(replicas):
            argv = [sys.executable, "-m", "deploy.cli", "router", "--config", str(path), "--replica", str(k)]
            self._start(f"replica-{k}", [*argv, "--log-level", log_level], env)
        for port in ports:
            self._wait_ok(f"http://127.0.0.1:{port}/health", start_timeout)
        haproxy_cfg = self.folder / "haproxy.cfg"
        haproxy_cfg.write_text(haproxy_config(load_config(path)))
        self._start("haproxy", [haproxy_binary(), "-db", "-f", str(haproxy_cfg)], env)
        url = f"http://127.0.0.1:{front}"
        self._wait_ok(f"{url}/health", start_timeout)
        return url

    def _start_router(
        self, name: str, config: Path, url: str, env: dict, cwd: Path, log_level: str, start_timeout: float
    ) -> None:
        argv = [sys.executable, "-m", "deploy.cli", "router", "--config", str(config), "--log-level", log_level]
        self._start(name, argv, env, cwd)
        self._wait_ok(f"{url}/health", start_timeout)

    def _start(self, name: str, argv: list[str], env: dict, cwd: Path = REPO) -> None:
        log = open(self.folder / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def _wait_ok(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited:\n" + "\n".join(self.log(n) for n in dead))
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout} s")
            time.sleep(0.1)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    @property
    def router_pid(self) -> int:
        return self.procs["router"].pid

    def stats(self, role: str) -> dict:
        url = self.prefill_url if role == "prefill" else self.decode_url
        return httpx.get(f"{url}/stub/stats", timeout=5.0).json()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> StubCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
