"""The namespace harness itself: hosts reach each other over the bridge and only
there, names resolve inside them, and everything it made is gone afterwards,
also when the code inside failed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.multihost.netns import NETNS_ETC, SUBNET, NetnsUnavailable, Network, remove_leftovers
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PREFIX = "pdmh-unit-"


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _alive(pid: int) -> bool:
    return subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0


@pytest.fixture
def net():
    try:
        network = Network(PREFIX)
    except NetnsUnavailable as exc:
        pytest.fail(f"cannot make network namespaces: {exc}")
    with network:
        yield network


def test_hosts_talk_over_the_bridge_and_the_bytes_show_on_their_veths(net, tmp_path):
    a, b = net.add_host("a"), net.add_host("b")
    assert (a.address, b.address) == (f"{SUBNET}.10", f"{SUBNET}.11")
    server = net.spawn(
        b,
        [
            sys.executable,
            "-c",
            (
                f"import socket; s = socket.create_server(('{b.address}', 7000)); c, _ = s.accept(); "
                "n = 0\nwhile (d := c.recv(65536)): n += len(d)\nprint(n)"
            ),
        ],
        stdout=tmp_path / "n",
    )
    sent_before, received_before = net.counters(a)[1], net.counters(b)[0]
    conns = []

    def connected() -> bool:
        try:
            conns.append(socket.create_connection((b.address, 7000), timeout=5))
        except ConnectionRefusedError:  # not listening yet
            return False
        return True

    with net.entered(a):
        wait_until(connected, 30, "b listens on 7000")
        conns[0].sendall(b"x" * 1_000_000)
        conns[0].close()
    assert server.wait(30) == 0
    assert int((tmp_path / "n").read_text()) == 1_000_000
    assert net.counters(a)[1] - sent_before >= 1_000_000
    assert net.counters(b)[0] - received_before >= 1_000_000


def test_a_host_has_only_its_subnet_route_and_no_way_out(net):
    a = net.add_host("a")
    routes = json.loads(
        subprocess.run(["ip", "-n", a.netns, "-j", "route", "show"], capture_output=True, text=True, check=True).stdout
    )
    assert [r["dst"] for r in routes] == [f"{SUBNET}.0/24"]
    with net.entered(a), pytest.raises(OSError), socket.create_connection(("10.214.0.1", 80), timeout=2):
        pass
    bridge_addresses = json.loads(
        subprocess.run(
            ["ip", "-n", f"{PREFIX}bridge", "-j", "addr", "show", "br0"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert [i for i in bridge_addresses[0]["addr_info"] if i["family"] == "inet"] == []


def test_names_resolve_inside_the_hosts(net, tmp_path):
    a, b = net.add_host("a"), net.add_host("b")
    net.names({"a.example.test": a.address, "b.example.test": b.address})
    proc = net.spawn(
        a,
        [sys.executable, "-c", "import socket; print(socket.gethostbyname('b.example.test'))"],
        stdout=tmp_path / "out",
    )
    assert proc.wait(30) == 0
    assert (tmp_path / "out").read_text().strip() == b.address


def test_everything_made_is_gone_after_a_failure_inside():
    with pytest.raises(RuntimeError, match="the test failed"):
        with Network(PREFIX) as network:
            host = network.add_host("a")
            network.names({"a.example.test": host.address})
            proc = network.spawn(host, [sys.executable, "-c", "import time; time.sleep(600)"])
            assert sorted(_netns()) == [f"{PREFIX}a", f"{PREFIX}bridge"]
            raise RuntimeError("the test failed")
    assert _netns() == []
    assert not _alive(proc.pid)
    assert not (NETNS_ETC / f"{PREFIX}a").exists()


def test_leftovers_of_a_killed_run_are_removed_at_start():
    subprocess.run(["ip", "netns", "add", f"{PREFIX}stale"], check=True)
    with Network(PREFIX) as network:
        assert f"{PREFIX}stale" not in _netns()
        network.add_host("a")
    assert remove_leftovers(PREFIX) == []
