"""Linux network namespaces as hosts, for multi-host tests and benchmarks.

::

    namespace PREFIX+bridge:   br0 ── b-router ── b-d0 ── b-p0 ...   (no address: a switch)
                                        │          │        │
    namespace PREFIX+router:  v-router 10.213.0.10 │        │
    namespace PREFIX+d0:                v-d0 10.213.0.11    │
    namespace PREFIX+p0:                          v-p0 10.213.0.12

Every host is a namespace with its loopback up and one veth whose peer sits
on a bridge in a namespace of its own, so nothing is created in the root
namespace: no interface, no route, no address. Addresses lie inside
10.213.0.0/24 and a host has no default route, so no packet can go anywhere
but to another host of the same ``Network``. Deleting a namespace deletes its
veths with it.

``Network`` is a context manager: on exit (also when the test failed) it
stops every process it started, by pid, kills whatever else still runs in its
namespaces, deletes the namespaces and their ``/etc/netns/NAME`` folders.
It first removes leftovers of an earlier run with the same prefix (a run
killed before its cleanup). ``ip netns exec NAME`` bind-mounts
``/etc/netns/NAME/hosts`` over ``/etc/hosts``: ``names()`` uses that to give
hosts DNS-style names without a DNS server.

Needs root (``ip netns add``); ``NetnsUnavailable`` says why when it fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.0"  # /24; the only addresses a Network hands out
FIRST_HOST = 10
CLONE_NEWNET = 0x40000000
NETNS_ETC = Path("/etc/netns")


class NetnsUnavailable(RuntimeError):
    """Namespaces, veths or the bridge could not be made here (not root, no ``ip``, no veth module)."""


@dataclass(frozen=True)
class Host:
    name: str  # short name, e.g. "d0"
    netns: str  # the namespace, PREFIX + name
    device: str  # the veth inside the namespace (UCX_NET_DEVICES)
    address: str  # its IPv4 address in SUBNET


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed") from None
    if done.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _kill_pids_in(netns: str) -> None:
    """SIGKILL whatever still runs in ``netns`` (processes of this Network, by the pids the kernel lists)."""
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
    for pid in done.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_netns(netns: str) -> None:
    _kill_pids_in(netns)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def remove_leftovers(prefix: str) -> list[str]:
    """Deletes every namespace (and its /etc/netns folder) whose name starts with ``prefix``."""
    found = [n for n in _netns_list() if n.startswith(prefix)]
    for netns in found:
        _delete_netns(netns)
    if NETNS_ETC.is_dir():
        for folder in NETNS_ETC.iterdir():
            if folder.name.startswith(prefix):
                shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only when empty: other namespaces' folders stay
    return found


class Network:
    """Hosts on one switch. ``prefix`` names every namespace it makes; keep it unique per test."""

    def __init__(self, prefix: str) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (ip netns add); this process is not root")
        self.prefix = prefix
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._bridge = prefix + "bridge"
        remove_leftovers(prefix)
        try:
            self._add_netns(self._bridge)
            _ip("-n", self._bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._bridge, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_netns(self, netns: str) -> None:
        _ip("netns", "add", netns)
        self._made.append(netns)
        _ip("-n", netns, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge with the next address of SUBNET."""
        index = FIRST_HOST + len(self.hosts)
        assert index < 255, "SUBNET is full"
        host = Host(name=name, netns=self.prefix + name, device=f"v-{name}"[:15], address=f"{SUBNET}.{index}")
        peer = f"b-{name}"[:15]
        self._add_netns(host.netns)
        _ip(
            "link", "add", host.device, "netns", host.netns, "type", "veth", "peer", "name", peer, "netns", self._bridge
        )
        _ip("-n", self._bridge, "link", "set", peer, "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.device)
        _ip("-n", host.netns, "link", "set", host.device, "up")
        self.hosts[name] = host
        return host

    def names(self, mapping: dict[str, str]) -> None:
        """Writes ``/etc/netns/NS/hosts`` for every host: each DNS-style name -> its address, as
        processes started with ``spawn`` (``ip netns exec``) see in /etc/hosts."""
        text = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in mapping.items())
        for host in self.hosts.values():
            folder = NETNS_ETC / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(text)

    def spawn(
        self,
        host: Host,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        log: Path | None = None,
        stdout: Path | None = None,
    ) -> subprocess.Popen:
        """``argv`` run inside ``host`` (``ip netns exec`` execs it: the pid is the program's); its
        output goes to ``log``, or its stdout alone to ``stdout`` when given."""
        with contextlib.ExitStack() as files:
            err = files.enter_context(open(log, "wb")) if log is not None else subprocess.DEVNULL
            out = files.enter_context(open(stdout, "wb")) if stdout is not None else err
            proc = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *argv],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=err if stdout is not None else subprocess.STDOUT,
            )
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def counters(self, host: Host) -> tuple[int, int]:
        """(rx bytes, tx bytes) of the host's veth."""
        link = json.loads(_ip("-n", host.netns, "-j", "-s", "link", "show", "dev", host.device))[0]
        stats = link["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    @contextlib.contextmanager
    def entered(self, host: Host):
        """The calling thread inside ``host``'s network namespace (sockets it opens meanwhile live
        there); it goes back on exit. Other threads are not moved."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{host.netns}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise NetnsUnavailable(f"setns into {host.netns}: {os.strerror(ctypes.get_errno())}")
            try:
                yield host
            finally:
                assert libc.setns(own, CLONE_NEWNET) == 0, os.strerror(ctypes.get_errno())
        finally:
            os.close(target)
            os.close(own)

    def close(self) -> None:
        """Stops every process, deletes every namespace (veths go with them) and /etc/netns folder."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + 10
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for netns in reversed(self._made):
            _delete_netns(netns)
        self._made.clear()
        remove_leftovers(self.prefix)
