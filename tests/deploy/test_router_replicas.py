"""router.replicas: the replicas' ports, their shares of each worker and of each tenant's limits, the
HAProxy front `pdserve launch` renders for them, and a launch without haproxy stopped at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from deploy import front
from deploy.config import parse_config, replica_share
from deploy.front import haproxy_config
from deploy.launcher import launch
from deploy.ports import ports_of
from router.api.response_store import SqliteResponseStore, StoredResponse
from tests.support.cluster import REPO, Cluster, free_ports, make_config
from tests.support.configs import BASE, error_of
from tests.waiting import wait_until


def replicated(replicas: int = 3, **router) -> dict:
    return {**BASE, "router": {"port": 9000, "replicas": replicas, **router}}


def test_one_router_by_default_serves_on_its_port_with_every_limit_whole(tmp_path):
    cluster = parse_config({**BASE, "router": {"port": 9000, "max_inflight_per_worker": 8}}, "c.yaml")
    assert cluster.router.replicas == 1 and cluster.router_replica_ports == []
    settings = cluster.router_settings(tmp_path)
    assert (settings.port, settings.limit_share) == (9000, 1.0)
    assert [w.max_inflight for w in settings.workers] == [8, 8]
    assert [u.what for u in ports_of(cluster)] == ["router", "p0 (HTTP)", "d0 (HTTP)", "d0 (kv_port)"]


def test_replica_ports_follow_the_front_port_unless_listed():
    cluster = parse_config(replicated(), "c.yaml")
    assert cluster.router_replica_ports == [9001, 9002, 9003]
    assert cluster.router_replica_url(2) == "http://127.0.0.1:9003"
    routers = [(u.port, u.what, u.owner) for u in ports_of(cluster) if u.owner == "router"]
    assert routers == [(9000, "router", "router"), (9001, "router-0", "router"), (9002, "router-1", "router")] + [
        (9003, "router-2", "router")
    ]
    assert ports_of(cluster, {"p0"}) == [u for u in ports_of(cluster) if u.owner == "p0"]
    listed = parse_config(replicated(2, replica_ports=[9500, 9600]), "c.yaml")
    assert listed.router_replica_ports == [9500, 9600]


def test_replica_ports_are_checked_like_every_other_port():
    assert "repeated: [9100, 9101]" in error_of({**BASE, "router": {"port": 9099, "replicas": 2}})  # p0's ports
    assert "repeated: [9200]" in error_of(replicated(2, replica_ports=[9200, 9300]))  # d0's port
    assert "repeated: [9300]" in error_of(replicated(2, replica_ports=[9300, 9300]))
    assert "lists 1 ports for 2 replicas: one each" in error_of(replicated(2, replica_ports=[9300]))
    assert "must be ports (1-65535)" in error_of(replicated(2, replica_ports=[9300, 70000]))
    assert "set router.replica_ports" in error_of(replicated(2, port=65535))
    assert "bad value 0 for 'router.replicas'" in error_of(replicated(0))


@pytest.mark.parametrize(
    ("limit", "replicas", "parts"),
    [(8, 3, [3, 3, 2]), (8, 2, [4, 4]), (7, 4, [2, 2, 2, 1]), (1, 2, [1, 1]), (5, 1, [5])],
)
def test_replicas_split_each_limit_floor_first_remainder_to_the_first(limit, replicas, parts):
    assert [replica_share(limit, replicas, k) for k in range(replicas)] == parts
    if limit >= replicas:  # together exactly the worker's limit
        assert sum(parts) == limit
    assert replica_share(limit, replicas, None) == max(1, limit // replicas)  # a pod that has no index


def test_each_replica_gets_its_port_its_share_of_every_worker_and_of_tenant_limits(tmp_path):
    data = replicated(3, max_inflight_per_worker=8)
    data["decode"] = [{"name": "d0", "port": 9200, "block_size": 32, "max_inflight": 4}]
    cluster = parse_config(data, "c.yaml")
    settings = [cluster.router_settings(tmp_path, replica=k) for k in range(3)]
    assert [s.port for s in settings] == [9001, 9002, 9003]
    assert [[w.max_inflight for w in s.workers] for s in settings] == [[3, 2], [3, 1], [2, 1]]
    assert {s.limit_share for s in settings} == {1 / 3}
    pod = cluster.router_settings(tmp_path)  # a Kubernetes pod: router.port, the floor part
    assert (pod.port, [w.max_inflight for w in pod.workers], pod.limit_share) == (9000, [2, 1], 1 / 3)
    dns = parse_config({**data, "discovery": {"kind": "dns", "names": ["d:9200"]}}, "c.yaml")
    assert [dns.router_settings(tmp_path, replica=k).discovery.max_inflight for k in range(3)] == [3, 3, 2]
    with pytest.raises(ValueError, match="router replica 3 does not exist: router.replicas is 3"):
        cluster.router_settings(tmp_path, replica=3)


def test_kubernetes_router_replicas_may_only_repeat_router_replicas():
    assert parse_config({**replicated(2), "kubernetes": {"router_replicas": 2}}, "c.yaml").router.replicas == 2
    msg = error_of({**replicated(2), "kubernetes": {"router_replicas": 3}})
    assert "kubernetes.router_replicas (3) differs from router.replicas (2)" in msg


def test_haproxy_balances_health_checked_replicas_with_stream_friendly_timeouts():
    cluster = parse_config(
        replicated(2, host="127.0.0.1", bind_host="0.0.0.0", max_connections_per_client=100, queue_timeout_s=2.5),
        "c.yaml",
    )
    lines = [line.strip() for line in haproxy_config(cluster).splitlines()]
    assert "bind 0.0.0.0:9000" in lines
    assert "balance leastconn" in lines
    assert "option httpchk GET /health" in lines and "http-check expect status 200" in lines
    assert "default-server inter 1000ms fastinter 500ms fall 2 rise 1" in lines
    assert [line for line in lines if line.startswith("server ")] == [
        "server router-0 127.0.0.1:9001 check maxconn 100",
        "server router-1 127.0.0.1:9002 check maxconn 100",
    ]
    for timeout in ("timeout server 3600s", "timeout tunnel 3600s", "timeout client 3600s", "timeout queue 2500ms"):
        assert timeout in lines
    assert "option http-keep-alive" in lines and "option forwardfor" in lines
    assert not any("buffer" in line for line in lines)  # responses stream through as they come
    assert "mode http" in lines and "option redispatch" in lines


def test_a_launch_of_replicas_without_haproxy_stops_at_once_naming_the_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(front, "SBIN_DIRS", ())
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(replicated(2)))
    run_dir = tmp_path / "run"
    assert launch(config, run_dir) == 1
    err = capsys.readouterr().err
    assert "haproxy is not installed" in err and "apt-get install haproxy" in err
    assert not run_dir.exists()  # nothing was started


def served(url: str) -> float:
    """Completions a router answered 200, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("pdserve_router_requests_total{") and 'status="200"' in line
    )


def complete(url: str) -> httpx.Response:
    """One completion through ``url`` on a connection of its own (the front balances connections)."""
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def restarted(run_dir: Path, name: str) -> bool:
    path = run_dir / "restarts.json"
    if not path.exists():
        return False
    return any(r["name"] == name and r["back_after_s"] is not None for r in json.loads(path.read_text())["restarts"])


def haproxy_missing() -> str | None:
    """Why `pdserve launch` cannot put HAProxy in front here (a skip reason; .ci/run installs it), or None."""
    try:
        front.haproxy_binary()
    except front.FrontMissing as exc:
        return str(exc)
    return None


@pytest.mark.integration
@pytest.mark.skipif(haproxy_missing() is not None, reason=str(haproxy_missing()))
def test_two_routers_behind_haproxy_share_the_load_and_survive_one_killed(tmp_path, tiny_model):
    config = make_config(tmp_path, "colocated", tiny_model, {"router": {"replicas": 2}})
    data = yaml.safe_load(config.read_text())
    taken = {data["router"]["port"], *(p for i in data["colocated"] for p in (i["port"], i["kv_port"]))}
    data["router"]["replica_ports"] = [p for p in free_ports(6) if p not in taken][:2]
    config.write_text(yaml.safe_dump(data))
    cluster = Cluster(config, tmp_path)
    try:
        procs = {p["name"]: p for p in cluster.manifest["processes"]}
        assert {n: p["role"] for n, p in procs.items()} == {
            "c0": "colocated",
            "router-0": "router",
            "router-1": "router",
            "haproxy": "front",
        }
        front_url = cluster.router_url
        assert front_url.endswith(f":{data['router']['port']}")
        routers = [procs["router-0"]["url"], procs["router-1"]["url"]]
        assert [u.rsplit(":", 1)[1] for u in routers] == [str(p) for p in data["router"]["replica_ports"]]
        assert (tmp_path / "haproxy.cfg").read_text() == haproxy_config(parse_config(data, "c.yaml"))

        for _ in range(6):
            assert complete(front_url).status_code == 200
        counts = [served(u) for u in routers]
        assert sum(counts) == 6 and all(c > 0 for c in counts), counts

        os.kill(procs["router-0"]["pid"], signal.SIGKILL)
        for _ in range(6):  # at once: a refused connection is redispatched to the live router
            response = complete(front_url)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 3
        assert served(routers[1]) == counts[1] + 6

        wait_until(lambda: restarted(tmp_path, "router-0"), 60, "the launcher restarted router-0 and it is healthy")

        def back_in_rotation() -> bool:  # HAProxy's next good check takes the new router-0 back
            assert complete(front_url).status_code == 200
            return served(routers[0]) > 0

        wait_until(back_in_rotation, 30, "requests through the front reach the restarted router-0")

        os.kill(procs["haproxy"]["pid"], signal.SIGKILL)  # the front is supervised like the rest
        wait_until(lambda: restarted(tmp_path, "haproxy"), 60, "the launcher restarted HAProxy and it answers")
        assert complete(front_url).status_code == 200
    finally:
        cluster.stop()


WRITER = """
import sys
from router.api.response_store import SqliteResponseStore, StoredResponse
path, me = sys.argv[1], sys.argv[2]
store = SqliteResponseStore(path)  # every replica opens the file at once: the WAL switch and the schema race
for i in range(100):
    store.put(StoredResponse(f"resp_{me}_{i}", "owner", 1e12, {"id": f"resp_{me}_{i}"}, [], []))
    store.append_events(f"resp_{me}_0", [(i, f"event {i} of {me}")])
print(store.take_lease("resp_orphan", me, until=2e12, now=1e12))
"""


def test_the_replicas_one_sqlite_file_takes_their_writes_at_once_and_one_lease_winner(tmp_path):
    """What `pdserve launch` gives the replicas: one SQLite file in the run folder, written by several
    processes at once (WAL mode; sqlite3's busy timeout queues a writer behind another instead of failing)."""
    path = str(tmp_path / "responses.sqlite")
    store = SqliteResponseStore(path)
    store.put(StoredResponse("resp_orphan", "owner", 1e12, {"id": "resp_orphan"}, [], []))
    assert store.renew_lease("resp_orphan", "a router that died", until=0.0)  # long expired: up for adoption
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, path, f"r{k}"], cwd=REPO, stdout=subprocess.PIPE, text=True)
        for k in range(3)
    ]
    outputs = [w.communicate(timeout=120)[0].split() for w in writers]
    assert [w.returncode for w in writers] == [0, 0, 0]
    assert sorted(o[-1] for o in outputs) == ["False", "False", "True"]  # exactly one adopts it
    assert store.count() == 1 + 300
    for k in range(3):
        assert store.events_after(f"resp_r{k}_0", -1, 1000) == [(i, f"event {i} of r{k}") for i in range(100)]
        assert store.get(f"resp_r{k}_99", "owner") is not None
    store.close()
