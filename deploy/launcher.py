"""Start a whole cluster from one config, watch it, stop it cleanly.

Order: check that every port the cluster binds is free (``deploy/ports.py``),
build the model if it is a built-in one not built yet, start every
prefill/decode/colocated server, wait until each answers /health with this
launch's nonce, start the router, wait for it, write ``RUN_DIR/cluster.json``
and print the endpoint. With ``router.replicas`` N > 1 "the router" is N
routers (``router-0`` .. on ``router.replica_ports``, each told which it is,
all on the run folder's one response store) and HAProxy in front of them on
``router.port`` (deploy/front.py, config ``RUN_DIR/haproxy.cfg``), started
once they answer; HAProxy is a supervised process like the others.
Then watch: Ctrl-C or SIGTERM stops every process; a process that fails is
restarted by ``deploy.supervisor`` (config ``restart:``) while the rest keep
serving; a server restarts in the role it was last switched to, which it records in
``RUN_DIR/roles/<name>.json`` (deploy/role_file.py). A server stopped by someone else's SIGTERM drains first and exits
cleanly; that is an operator's choice, not a failure, so the cluster keeps
serving as long as the router and at least one server of each role remain.

Stopping drains: the routers first (new requests get 503, those in flight
finish), then the front, then the servers (nothing is in flight on them by
then); each gets ``drain_timeout_s`` plus a grace period before SIGKILL. Each process logs to
``RUN_DIR/<name>.log``; while the cluster serves, the launcher's terminal shows
every process's stats lines (``server_common/stats_log.py``), prefixed with
its name.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import httpx

from deploy.config import ClusterConfig, load_config
from deploy.config_security import GENERATED_SECRET_ENV
from deploy.front import FRONT_NAME, FrontMissing, haproxy_binary, write_haproxy_config
from deploy.kv_memory import HostMemory, KvMemoryError, describe
from deploy.ports import busy_ports
from deploy.progress import Heartbeat, seconds_since_process_start
from deploy.role_file import RoleFile
from deploy.supervisor import Supervisor
from engine.models import needs_build

GRACE_S = 10.0
REPO_ROOT = Path(__file__).resolve().parents[1]
# libgomp's spin between parallel kernels, in pause iterations, for servers that share their cores.
SHARED_CORES_SPINCOUNT = "10000"


def routes_here(only: set[str] | None) -> bool:
    """Whether this launcher starts the router (and what routes beside it): on every host of ``--only``'s
    list that names it, or the one host of a cluster launched whole."""
    return only is None or "router" in only


def openmp_spin(cluster: ClusterConfig, only: set[str] | None, cores: int) -> dict[str, str]:
    """The OpenMP environment of the servers this launcher starts: a short spin when their torch
    threads outnumber its cores, or fill them beside the router it also starts here, nothing otherwise.

    A server's OpenMP workers spin between the kernels of a step (libgomp's default, about 300000
    pause iterations), which is what makes a CPU step fast when they have cores of their own
    (server_common/engine_thread.py ``build_engine``). On cores shared with other servers, or with
    the router that streams their tokens (and the clients beside it), a long spin takes the time the
    other process needs, and its work then waits for the spinner's step; no spin at all
    (``OMP_WAIT_POLICY=PASSIVE``) makes every kernel a wake-up. ``GOMP_SPINCOUNT=10000`` spans the gap
    between one step's kernels and yields soon after (measured: docs/architecture.md, Threads). Nothing
    is set when ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is (the operator's choice stands)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    threads = 0
    for inst in cluster.instances():
        if only is None or inst.name in only:
            per_rank = inst.num_threads or cluster.engine.num_threads or cores  # None: torch's default, the cores
            threads += per_rank * cluster.tensor_parallel_size_of(inst)
    shared = threads > cores or (threads == cores and routes_here(only))
    return {"GOMP_SPINCOUNT": SHARED_CORES_SPINCOUNT} if shared else {}


# processes whose exit is always a failure (no server drains behind them)
ROUTING_ROLES = ("planner", "router", "front")


class LaunchError(RuntimeError):
    pass


@dataclass
class Proc:
    role: str
    name: str
    url: str
    log: Path
    popen: subprocess.Popen

    def describe(self) -> dict:
        return {"role": self.role, "name": self.name, "pid": self.popen.pid, "url": self.url, "log": str(self.log)}

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Cluster:
    def __init__(self, config_path: Path, cluster: ClusterConfig, run_dir: Path, only: set[str] | None = None) -> None:
        self.config_path = config_path.resolve()
        self.cluster = cluster
        self.run_dir = run_dir
        self.only = only  # this host's processes of a multi-host cluster (None: all of them)
        self.procs: list[Proc] = []
        self.stopped: set[str] = set()  # servers that drained and stopped on someone else's SIGTERM
        # Every child reports it in /health: an answer without it comes from a process this launch did not start.
        self.launch_id = secrets.token_hex(8)
        self.openmp_env = openmp_spin(cluster, only, len(os.sched_getaffinity(0)))
        # The config of each server the config file does not list (deploy/launch_scale.py adds them).
        self.configs: dict[str, Path] = {}
        # Each server's KV cache where the config says auto, sized for this host's servers together.
        self.kv_cache_bytes: dict[str, int] = {}

    def _spawn(self, role: str, name: str, url: str, args: list[str]) -> Proc:
        cmd = [sys.executable, "-m", "deploy.cli", *args, "--config", str(self.configs.get(name, self.config_path))]
        cmd += ["--launch-id", self.launch_id]  # it reports it in /health: what wait_healthy checks
        if self.only is not None and role == "router":
            cmd += ["--any-worker-launch"]  # a multi-host cluster's other hosts run servers of other launches
        # Children import this very checkout, whatever the working directory or installed copy.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        if role != "router":
            env.update(self.openmp_env)
        return self._popen(role, name, url, cmd, env)

    def _popen(self, role: str, name: str, url: str, cmd: list[str], env: dict[str, str]) -> Proc:
        log = self.run_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )  # our signals reach it only through us
        proc = Proc(role, name, url, log, popen)
        self.procs.append(proc)
        return proc

    def start_servers(self) -> list[Proc]:
        started = []
        for role in ("prefill", "decode", "colocated"):
            command = "prefill" if role == "prefill" else "decode"
            for inst in getattr(self.cluster, role):
                if self.only is not None and inst.name not in self.only:
                    continue
                started.append(
                    self._spawn(role, inst.name, self.cluster.url_of(inst), self.server_args(command, inst.name))
                )
        return started

    def role_file(self, name: str) -> Path:
        """Where server ``name`` records its role (deploy/role_file.py): a restart starts in that role."""
        return self.run_dir / "roles" / f"{name}.json"

    def last_role(self, name: str) -> str | None:
        """The role server ``name`` recorded last, which a restart starts in (None: none recorded)."""
        record = RoleFile(self.role_file(name), name, self.launch_id).read()
        return None if record is None else record.role

    def server_args(self, command: str, name: str) -> list[str]:
        args = [command, "--name", name, "--role-file", str(self.role_file(name))]
        if name in self.kv_cache_bytes:
            args += ["--kv-cache-bytes", str(self.kv_cache_bytes[name])]
        return args

    def size_kv_caches(self, model: Path) -> str | None:
        """Size the KV cache of each server this host starts whose config says ``kv_cache_bytes: auto``, from
        the memory the host has now, before any of them takes some (deploy/kv_memory.py); the line saying
        what was chosen, or None where no server's is auto. KvMemoryError where the host has too little."""
        names = [i.name for i in self.cluster.instances() if self.only is None or i.name in self.only]
        memory = HostMemory.read()
        self.kv_cache_bytes = self.cluster.auto_kv_cache_bytes(names, model, memory)
        if not self.kv_cache_bytes:
            return None
        servers = [self.cluster.kv_memory(n, model) for n in names if n in self.kv_cache_bytes]
        return describe(memory, servers, self.kv_cache_bytes, self.cluster.engine.kv_cache_memory_fraction)

    def router_args(self, replica: int | None = None) -> list[str]:
        """The router keeps stored /v1/responses in the run folder, so a restarted router still has them;
        replicas share that one file (SQLite in WAL mode), so any of them serves any stored or background
        response. ``replica``: which of ``router.replicas`` it is (its port and its shares)."""
        args = ["router", "--response-store", str(self.run_dir / "responses.sqlite")]
        return args if replica is None else [*args, "--replica", str(replica)]

    @property
    def replicated(self) -> bool:
        return self.cluster.router.replicas > 1

    def start_routers(self) -> list[Proc]:
        """The router, or with ``router.replicas`` > 1 each replica on its own port."""
        if not self.replicated:
            return [self._spawn("router", "router", self.cluster.router_url, self.router_args())]
        return [
            self._spawn("router", f"router-{k}", self.cluster.router_replica_url(k), self.router_args(k))
            for k in range(self.cluster.router.replicas)
        ]

    def start_planner(self) -> Proc:
        """The planner (deploy/planner_cli.py), once the routers it reads answer."""
        url = f"http://{self.cluster.router_host}:{self.cluster.planner.port}"
        return self._spawn("planner", "planner", url, ["planner"])

    def start_front(self) -> Proc:
        """HAProxy in front of the replicas, in the foreground (``-db``), so that its pid is the one to stop."""
        config = write_haproxy_config(self.cluster, self.run_dir)
        cmd = [haproxy_binary(), "-db", "-f", str(config)]
        return self._popen("front", FRONT_NAME, self.cluster.router_url, cmd, dict(os.environ))

    def wait_healthy(
        self, procs: list[Proc], timeout: float, stop: threading.Event, on_ready: Callable[[Proc], None] | None = None
    ) -> None:
        """Until every one of ``procs`` answers its health check (``on_ready`` is told of each)."""
        pending = list(procs)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for proc in list(pending):
                    code = proc.popen.poll()
                    if code is not None:
                        raise LaunchError(
                            f"{proc.role} {proc.name} exited with status {code} while starting; "
                            f"last lines of {proc.log}:\n{proc.log_tail()}"
                        )
                    try:
                        if self._healthy(proc, client.get(f"{proc.url}/health")):
                            pending.remove(proc)
                            if on_ready is not None:
                                on_ready(proc)
                    except httpx.HTTPError:
                        pass
                if stop.is_set():
                    raise KeyboardInterrupt
                if time.monotonic() > deadline:
                    names = ", ".join(p.name for p in pending)
                    raise LaunchError(f"not healthy after {timeout:.0f} s: {names} (see logs in {self.run_dir})")
                if pending:
                    stop.wait(0.2)

    def _healthy(self, proc: Proc, resp: httpx.Response) -> bool:
        """True when ``proc`` itself says it is healthy; a LaunchError when another process answers."""
        try:
            body = resp.json()
        except ValueError:
            body = None
        report = body if isinstance(body, dict) else {}
        ours = report.get("launch_id") == self.launch_id and report.get("instance", proc.name) == proc.name
        if not ours and (resp.status_code == 200 or "launch_id" in report):
            raise LaunchError(
                f"{proc.url}/health is answered by a process this launch did not start "
                f"(launch {report.get('launch_id')!r}, instance {report.get('instance')!r}), not by "
                f"{proc.role} {proc.name} (pid {proc.popen.pid}); is another cluster on its port?"
            )
        return resp.status_code == 200

    def restart(self, name: str) -> Proc:
        """Start process ``name`` again once it has exited (fault tests kill servers on purpose); a server
        starts in the role its role file recorded (the one it was last switched to)."""
        old = next(p for p in self.procs if p.name == name)
        if old.popen.poll() is None:
            raise LaunchError(f"{old.role} {name} is still running (pid {old.popen.pid})")
        self.procs.remove(old)
        if old.role == "front":
            return self.start_front()
        if old.role == "planner":
            return self.start_planner()
        command = "decode" if old.role == "colocated" else old.role
        last = self.last_role(name) if old.role != "router" else None
        if last is not None and last != old.role:
            print(
                f"pdserve: {old.role} {name} starts again as a {last} server, the role it was last switched to",
                flush=True,
            )
        replica = int(name.rsplit("-", 1)[1]) if old.role == "router" and self.replicated else None
        args = self.router_args(replica) if old.role == "router" else self.server_args(command, name)
        return self._spawn(old.role, name, old.url, args)

    def first_dead(self, skip: Collection[str] = frozenset()) -> Proc | None:
        """The first process whose exit stops the cluster unless it is restarted (see the module
        docstring); processes named in ``skip`` (waiting for their restart) are passed over."""
        for proc in self.procs:
            if proc.name in skip:
                continue
            code = proc.popen.poll()
            if code is None:
                continue
            drained = proc.role not in ROUTING_ROLES and code in (0, -signal.SIGTERM)
            if not drained or not any(p.popen.poll() is None for p in self.procs if p.role == proc.role):
                return proc
            if proc.name not in self.stopped:
                self.stopped.add(proc.name)
                print(f"pdserve: {proc.role} {proc.name} drained and stopped; the cluster keeps serving", flush=True)
        return None

    def stop_all(self, hurry: threading.Event | None = None) -> None:
        """The planner first (it acts on the rest), then the routers (they drain), the front, and the servers;
        SIGKILL after drain timeout + grace, or at once once ``hurry`` is set (a second Ctrl-C)."""
        hurry = hurry or threading.Event()
        patience = self.cluster.drain_timeout_s + GRACE_S
        self._stop([p for p in self.procs if p.role == "planner"], patience, hurry)
        self._stop([p for p in self.procs if p.role == "router"], patience, hurry)
        self._stop([p for p in self.procs if p.role == "front"], patience, hurry)
        self._stop([p for p in self.procs if p.role not in ROUTING_ROLES], patience, hurry)

    @staticmethod
    def _stop(procs: list[Proc], patience: float, hurry: threading.Event) -> None:
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.terminate()
        deadline = time.monotonic() + patience
        for proc in procs:
            while proc.popen.poll() is None and time.monotonic() < deadline and not hurry.wait(0.05):
                pass
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()

    def write_manifest(self) -> Path:
        path = self.run_dir / "cluster.json"
        manifest = {
            "config": str(self.config_path),
            "router_url": self.cluster.router_url,
            "model": self.cluster.model_name,
            "launcher_pid": os.getpid(),
            "processes": [p.describe() for p in self.procs],
        }
        tmp = path.with_suffix(".json.tmp")  # rewritten on every restart: readers never see half of it
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, path)
        return path


STATS_MARK = b" pdserve.stats: "


class StatsEcho(threading.Thread):
    """Copies each process's stats lines from its log to this terminal as ``name | line``; a restarted
    process appends to the same log, so it is followed on."""

    def __init__(self, cluster: Cluster, stop: threading.Event, interval_s: float = 0.5) -> None:
        super().__init__(name="stats-echo", daemon=True)
        # Not ``_stop``: threading.Thread has a method of that name, which join() calls.
        self._cluster, self._quit, self._interval_s = cluster, stop, interval_s
        self._offsets = {proc.log: _size(proc.log) for proc in cluster.procs}  # from now on

    def run(self) -> None:
        while not self._quit.wait(self._interval_s):
            self.poll()

    def poll(self) -> None:
        for proc in list(self._cluster.procs):
            offset = self._offsets.get(proc.log, 0)
            try:
                with open(proc.log, "rb") as f:
                    f.seek(offset)
                    data = f.read(1 << 20)
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            self._offsets[proc.log] = offset + len(complete)
            for line in complete.splitlines():
                if STATS_MARK in line:
                    text = line.split(STATS_MARK, 1)[1].decode(errors="replace")
                    print(f"{proc.name} | {text}", flush=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def only_problem(cluster: ClusterConfig, only: set[str]) -> str | None:
    """Why ``--only`` cannot start these processes, or None."""
    names = {i.name for i in cluster.instances()} | {"router"}
    unknown = sorted(only - names)
    if unknown:
        return f"--only names {unknown}, which the config does not have (it has {sorted(names)})"
    if only != names and not cluster.security.configured:
        return (
            "a cluster whose processes run on several hosts needs security.internal_secret (or "
            "internal_secret_file) in the config: a secret generated on one host is not known on the others"
        )
    return None


def generate_secret(run_dir: Path) -> Path:
    """A per-cluster internal secret for a config that names none, so that the internal servers
    always refuse callers other than the router and each other: written to ``RUN_DIR/internal_secret``
    (mode 0600, never logged); children find it through ``GENERATED_SECRET_ENV``."""
    path = run_dir / "internal_secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    os.environ[GENERATED_SECRET_ENV] = str(path)  # inherited by every process this launcher starts
    return path


def launch(
    config_path: str | Path,
    run_dir: str | Path | None = None,
    health_timeout: float = 600.0,
    only: set[str] | None = None,
    on_up: Callable[[Cluster], Callable[[], None]] | None = None,
) -> int:
    """``only``: start just these processes (instance names, ``router``): one host of a multi-host
    cluster, whose other hosts run the rest with the same config. ``on_up(cluster)``: called once every
    process is up, before the supervision; what it returns is called when the supervision ends, before
    anything stops (`pdserve launch` starts deploy/launch_scale.py's pool scaler this way)."""
    # "up in X s" counts from the process's start: the CLI's own imports are part of the wait.
    started = time.monotonic() - (seconds_since_process_start() or 0.0)
    config_path = Path(config_path)
    cluster = load_config(config_path)
    if only is not None:
        problem = only_problem(cluster, only)
        if problem:
            print(f"pdserve launch: error: {config_path}: {problem}", file=sys.stderr, flush=True)
            return 2
    # before anything starts: another cluster's servers would answer our health checks
    problems = _front_missing(cluster, only) or busy_ports(cluster, only)
    if problems:
        print("pdserve launch: error: " + "\n".join(problems), file=sys.stderr, flush=True)
        return 1
    run_dir = Path(run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cluster.security.configured:
        generate_secret(run_dir)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    c = Cluster(config_path, cluster, run_dir, only)
    up = False
    try:
        model = _model_folder(cluster, started)
        try:
            sized = c.size_kv_caches(model)
        except KvMemoryError as exc:
            raise LaunchError(str(exc)) from None
        if sized:
            print(f"pdserve: {sized}", flush=True)
        _start_all(c, health_timeout, stop, started)
        up = True
        done = on_up(c) if on_up is not None else None
        try:
            if _supervise(c, stop):
                return 1
        finally:
            if done is not None:
                done()
        print("pdserve: stopping", flush=True)
        return 0
    except KeyboardInterrupt:
        print("pdserve: interrupted; stopping", flush=True)
        return 130
    except LaunchError as exc:
        print(f"pdserve launch: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        hurry = threading.Event()
        for sig in previous:
            signal.signal(sig, lambda *_: hurry.set())
        running = [p for p in c.procs if p.popen.poll() is None]
        if running and up:
            print(f"pdserve: draining (up to {cluster.drain_timeout_s:g} s); Ctrl-C again stops at once", flush=True)
        elif running:
            print(f"pdserve: stopping the {len(running)} processes started", flush=True)
        c.stop_all(hurry)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _front_missing(cluster: ClusterConfig, only: set[str] | None) -> list[str]:
    """Why the front of several routers cannot start here (HAProxy not installed), or nothing."""
    if cluster.router.replicas == 1 or not routes_here(only):
        return []
    try:
        haproxy_binary()
    except FrontMissing as exc:
        return [str(exc)]
    return []


def _model_folder(cluster: ClusterConfig, started: float) -> Path:
    """The model's folder, built first if it is a built-in one not built yet (saying so, with a
    heartbeat); LaunchError when the build took the ports meanwhile or TP cannot split it."""
    if needs_build(cluster.model, cluster.model_cache):
        print(
            f"pdserve: building model {cluster.model!r} into {cluster.model_cache} (first use only; minutes "
            f"on a small CPU)",
            flush=True,
        )
        with Heartbeat(f"building model {cluster.model!r}"):
            model = cluster.model_path()
        busy = busy_ports(cluster)  # the build took a while: check again
        if busy:
            raise LaunchError("\n".join(busy))
    else:
        model = cluster.model_path()
    print(f"pdserve: model folder {model} ({time.monotonic() - started:.1f} s)", flush=True)
    unsplittable = cluster.tensor_parallel_problems(model)
    if unsplittable:  # each server would fail its start, again at every restart
        raise LaunchError("tensor_parallel_size does not fit the model:\n" + "\n".join(unsplittable))
    return model


def _start_all(c: Cluster, health_timeout: float, stop: threading.Event, started: float) -> None:
    """The servers, then the router (this host's part of them), each healthy before the next
    step, saying what starts and when each is ready; then the manifest and the endpoint."""
    cluster, only = c.cluster, c.only

    def ready(proc: Proc) -> None:
        who = proc.name if proc.name == proc.role else f"{proc.role} {proc.name}"
        print(f"pdserve: {who} ready ({time.monotonic() - started:.1f} s)", flush=True)

    if c.openmp_env:
        print(
            f"pdserve: the servers' torch threads fill or outnumber this host's {len(os.sched_getaffinity(0))} cores: "
            f"{' '.join(f'{k}={v}' for k, v in c.openmp_env.items())} for them, a short OpenMP spin "
            "(set OMP_WAIT_POLICY or GOMP_SPINCOUNT to choose)",
            flush=True,
        )
    servers = c.start_servers()
    print(
        f"pdserve: starting {', '.join(f'{p.name} ({p.role})' for p in servers)}: each loads the model, "
        "then answers its health check",
        flush=True,
    )
    c.wait_healthy(servers, health_timeout, stop, ready)
    if routes_here(only):
        if c.replicated:
            print(f"pdserve: starting {cluster.router.replicas} routers, then HAProxy in front of them", flush=True)
        else:
            print("pdserve: starting the router", flush=True)
        c.wait_healthy(c.start_routers(), health_timeout, stop, ready)
        if c.replicated:
            c.wait_healthy([c.start_front()], health_timeout, stop, ready)
        if cluster.planner.mode != "off":
            print(f"pdserve: starting the planner ({cluster.planner.mode}, {cluster.planner.orchestrator})", flush=True)
            c.wait_healthy([c.start_planner()], health_timeout, stop, ready)
    manifest = c.write_manifest()
    if only is None:
        print(
            f"pdserve: {cluster.mode} cluster up in {time.monotonic() - started:.1f} s; "
            f"OpenAI endpoint {cluster.router_url}/v1 (model {cluster.model_name!r})",
            flush=True,
        )
    else:
        print(
            f"pdserve: {', '.join(p.name for p in c.procs)} up in {time.monotonic() - started:.1f} s "
            f"(this host's part; the cluster's OpenAI endpoint is {cluster.router_url}/v1)",
            flush=True,
        )
    print(f"pdserve: processes and pids in {manifest}; logs in {c.run_dir}; Ctrl-C stops everything", flush=True)


def _supervise(c: Cluster, stop: threading.Event) -> bool:
    """Restart what the config's ``restart`` allows until told to stop; True when a process died
    for good (its log's last lines said)."""
    supervisor = Supervisor(c, c.cluster.restart)
    if c.cluster.log_stats_interval_s > 0:
        StatsEcho(c, stop).start()
    while not stop.wait(0.2):
        dead = supervisor.tick()
        if dead is not None:
            print(
                f"pdserve: {dead.role} {dead.name} exited with status {dead.popen.returncode}; stopping "
                f"the cluster. Last lines of {dead.log}:\n{dead.log_tail()}",
                file=sys.stderr,
                flush=True,
            )
            return True
    return False
