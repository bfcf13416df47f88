"""Which ports a cluster binds on this machine, and whether each is free now.

``pdserve launch`` checks every port before it starts anything: a port that
another process holds would otherwise surface late, as one server dying on
"address already in use" while the other cluster's servers answer the health
checks meant for ours. The check binds each (host, port) the way uvicorn and
ZeroMQ do (``SO_REUSEADDR``, so sockets in TIME_WAIT do not count) and lets go
at once; a port in use is reported with its holder when ``/proc`` shows it,
and when the holder is a process another ``pdserve launch`` started, with
that launcher's pid and run folder: what the user stops, and where its logs are.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from deploy.config import ClusterConfig

LISTEN = "0A"  # the LISTEN state in /proc/net/tcp


@dataclass(frozen=True)
class PortUse:
    host: str
    port: int
    what: str  # e.g. "router", "d0 (HTTP)", "d0 (kv_port)"
    owner: str = ""  # the process that binds it: "router" or an instance name


def ports_of(cluster: ClusterConfig, only: set[str] | None = None) -> list[PortUse]:
    """Every (host, port) the cluster's processes listen on: the router's (and its replicas'), each server's HTTP
    port, and the kv_port of each decode server (the ZeroMQ receiver binds it; NIXL's UCX
    listener takes a port of its own choosing). ``only``: of these processes alone."""
    uses = [PortUse(cluster.router_bind_host, cluster.router.port, "router", "router")]
    uses += [
        PortUse(cluster.router_bind_host, port, f"router-{k}", "router")
        for k, port in enumerate(cluster.router_replica_ports)
    ]
    for inst in cluster.instances():
        uses.append(PortUse(cluster.bind_host_of(inst), inst.port, f"{inst.name} (HTTP)", inst.name))
        if inst in cluster.decode and cluster.transfer.backend == "zmq":
            uses.append(PortUse(cluster.bind_host_of(inst), inst.transfer_port, f"{inst.name} (kv_port)", inst.name))
    return [u for u in uses if only is None or u.owner in only]


def bind_error(host: str, port: int) -> OSError | None:
    """The error binding ``host:port`` gives now, or None when it is free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return OSError(errno.EADDRNOTAVAIL, f"cannot resolve {host!r}: {exc.strerror}")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return exc
    return None


def listeners(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def holders(port: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes this user may inspect that listen on ``port``."""
    wanted = {f"socket:[{inode}]" for inode in listeners(port)}
    found: list[tuple[int, str]] = []
    if not wanted:
        return found
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
            if not any(os.readlink(f"/proc/{entry.name}/fd/{fd}") in wanted for fd in fds):
                continue
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or another user's process
            continue
        found.append((int(entry.name), cmdline.strip()))
    return found


@dataclass(frozen=True)
class Launch:
    """A running ``pdserve launch``: its pid and the run folder its processes log into."""

    pid: int
    run_dir: str


def launch_of(pid: int) -> Launch | None:
    """The ``pdserve launch`` that started process ``pid``, if one did (its parent, running
    ``deploy.cli launch``; its children log into the run folder through their stdout)."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        parent = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
        log = Path(os.readlink(f"/proc/{pid}/fd/1"))
    except (OSError, ValueError, IndexError):
        return None
    if b"launch" not in parent or not any(arg.endswith((b"pdserve", b"deploy.cli")) for arg in parent):
        return None
    return Launch(ppid, str(log.parent))


def describe_holder(port: int) -> str:
    found = holders(port)
    if not found:
        return "held by a process this user cannot inspect" if listeners(port) else "in use"
    return "held by " + ", ".join(f"pid {pid} ({cmd[:120]})" for pid, cmd in found)


def launches_holding(ports: list[int]) -> list[Launch]:
    """The other ``pdserve launch`` runs whose processes hold any of ``ports``."""
    found = {launch_of(pid) for port in ports for pid, _ in holders(port)}
    return sorted((launch for launch in found if launch is not None), key=lambda launch: launch.pid)


def busy_ports(cluster: ClusterConfig, only: set[str] | None = None) -> list[str]:
    """One line per port the cluster (``only``: those processes) needs that cannot be bound now."""
    problems, in_use = [], []
    for use in ports_of(cluster, only):
        exc = bind_error(use.host, use.port)
        if exc is None:
            continue
        if exc.errno == errno.EADDRINUSE:
            problems.append(f"port {use.port} on {use.host} ({use.what}) is {describe_holder(use.port)}")
            in_use.append(use.port)
        else:
            problems.append(f"cannot bind {use.host}:{use.port} ({use.what}): {exc.strerror or exc}")
    for launch in launches_holding(in_use):
        problems.append(
            f"they belong to another `pdserve launch` (pid {launch.pid}, run dir {launch.run_dir}): "
            f"stop it with Ctrl-C in its terminal or `kill {launch.pid}`, or give this cluster other ports"
        )
    return problems
