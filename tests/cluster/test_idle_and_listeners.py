"""A loopback cluster exposes nothing beyond loopback, and an idle one costs
(almost) no CPU; with both transfer backends."""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path

import pytest

from deploy.config import load_config
from tests.support.cluster import start_cluster

pytestmark = pytest.mark.integration

IDLE_WINDOW_S = 10.0
IDLE_CPU_LIMIT = 0.03  # of one core per process; ~0 on a quiet machine, loose for a busy CI runner
TICK = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module", params=["zmq", "nixl"])
def cluster(request, tmp_path_factory, tiny_model):
    c = start_cluster(tmp_path_factory, "tiny-1p1d", tiny_model, {"transfer": {"backend": request.param}})
    # Serve one remote prefill first, so the KV connection is up: idle means idle after work.
    reply = c.client().completions.create(
        model="tiny",
        prompt="one two three four five six seven eight nine ten eleven twelve",
        max_tokens=4,
        temperature=0,
    )
    assert reply.usage.completion_tokens == 4
    c.wait_idle()
    yield c
    c.stop()


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))  # 32-bit words, host order


def bound_sockets(pid: int) -> list[tuple[str, str, int]]:
    """(protocol, address, port) of every TCP socket of ``pid`` that listens and every bound UDP socket."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]:
            fields = line.split()
            listening = fields[3] == "0A" if proto.startswith("tcp") else True
            if fields[9] in inodes and listening:
                address, port = fields[1].split(":")
                found.append((proto, str(_address(address)), int(port, 16)))
    return sorted(found)


def backend_of(cluster) -> str:
    return load_config(cluster.manifest["config"]).transfer.backend


def test_every_process_listens_on_loopback_only(cluster):
    backend = backend_of(cluster)
    for proc in cluster.manifest["processes"]:
        sockets = bound_sockets(proc["pid"])
        assert sockets, proc
        outside = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
        assert outside == [], f"{proc['name']} ({backend}) listens beyond loopback: {outside}"
        http_port = int(proc["url"].rsplit(":", 1)[1])
        assert ("tcp", "127.0.0.1", http_port) in sockets


def test_nixl_servers_have_a_ucx_listener_and_keep_it_on_loopback(cluster):
    if backend_of(cluster) != "nixl":
        return  # the zmq receiver binds kv_port on the configured host: covered by the test above
    for proc in cluster.servers:
        tcp = [s for s in bound_sockets(proc["pid"]) if s[0].startswith("tcp")]
        assert len(tcp) >= 2, tcp  # HTTP and UCX's own listener, both on 127.0.0.1
        assert {s[1] for s in tcp} == {"127.0.0.1"}


def _cpu_seconds(stat_path: str) -> float:
    """utime + stime of a process or thread (0 for a thread that has ended)."""
    try:
        stat = Path(stat_path).read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _threads(pid: int) -> dict[str, float]:
    return {tid: _cpu_seconds(f"/proc/{pid}/task/{tid}/stat") for tid in os.listdir(f"/proc/{pid}/task")}


def test_an_idle_cluster_costs_almost_no_cpu(cluster):
    procs = cluster.manifest["processes"]
    before = {p["name"]: (_cpu_seconds(f"/proc/{p['pid']}/stat"), _threads(p["pid"])) for p in procs}
    started = time.monotonic()
    time.sleep(IDLE_WINDOW_S)  # the measurement window itself, not a wait for some event
    window = time.monotonic() - started
    report = {}
    for p in procs:
        total = (_cpu_seconds(f"/proc/{p['pid']}/stat") - before[p["name"]][0]) / window
        threads = {tid: (s - before[p["name"]][1].get(tid, 0.0)) / window for tid, s in _threads(p["pid"]).items()}
        report[p["name"]] = (round(total, 3), {t: round(s, 3) for t, s in threads.items() if s > 0.001})
    busy = {name: r for name, r in report.items() if r[0] > IDLE_CPU_LIMIT}
    assert busy == {}, f"idle CPU (share of a core; per thread id) above {IDLE_CPU_LIMIT}: {report}"
