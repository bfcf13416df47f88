"""Workers joining and leaving a running cluster through the router's admin API
(real processes on 127.0.0.1): a decode server started later on its own (as
another host would, `pdserve launch CONFIG --only d1`) joins and serves
correct tokens, leaves with zero failed requests, and 20 join/leave cycles
leave the prefill server's memory and open files flat."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import Cluster, free_ports, make_config
from tests.support.oracle import expected_completion

pytestmark = pytest.mark.integration

SECRET = "a-test-secret-shared-by-both-launches"
PROMPT = "joining and leaving a cluster at runtime"


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory, tiny_model):
    """Launch A: p0, d0 and the router (config A lists only those). Launch B: d1 alone, from
    config B = A + d1 (what a second host runs)."""
    folder = tmp_path_factory.mktemp("discovery")
    path_a = make_config(
        folder, "tiny-1p1d", tiny_model, {"security": {"internal_secret": SECRET}, "engine": {"prefix_caching": False}}
    )
    data = yaml.safe_load(path_a.read_text())
    port, kv_port = free_ports(2)
    data_b = copy.deepcopy(data)
    data_b["decode"].append({"name": "d1", "port": port, "kv_port": kv_port, "block_size": 8})
    path_b = folder / "with-d1.yaml"
    path_b.write_text(yaml.safe_dump(data_b))
    (folder / "a").mkdir()
    (folder / "b").mkdir()
    a = Cluster(path_a, folder / "a", secret=SECRET)
    try:
        b = Cluster(path_b, folder / "b", only="d1", secret=SECRET)
    except BaseException:
        a.stop()
        raise
    yield a, b, f"http://127.0.0.1:{port}"
    b.stop()
    a.stop()


def answer(cluster: Cluster, tiny_model: str) -> None:
    out = cluster.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert (out.choices[0].text, out.usage.completion_tokens) == expected_completion(tiny_model, PROMPT, 4)


def prefill_usage(a: Cluster) -> tuple[int, int]:
    """(resident KiB, open file descriptors) of the prefill server."""
    pid = a.server("p0")["pid"]
    rss = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def test_a_decode_server_joins_serves_and_leaves_and_churn_leaves_nothing_behind(two_launches, tiny_model):
    a, b, d1_url = two_launches
    admin = a.http
    refused = admin.post(f"{a.router_url}/admin/workers", json={"url": a.router_url})  # not a worker
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_health_report"
    joined = admin.post(f"{a.router_url}/admin/workers", json={"url": d1_url}).json()
    assert (joined["name"], joined["role"]) == ("d1", "decode")
    peers = admin.get(f"{a.server('p0')['url']}/admin/peers").json()["peers"]
    assert peers == {"d0": a.server("d0")["url"], "d1": d1_url}  # the router announced d1 to p0
    admin.post(f"{a.router_url}/admin/workers/d0/drain")  # everything goes to d1 now
    reserved = b.metric("d1", 'pdserve_request_paths_total{path="remote_kv"}')
    for _ in range(3):
        answer(a, tiny_model)
    assert b.metric("d1", 'pdserve_request_paths_total{path="remote_kv"}') - reserved == 3
    left = admin.delete(f"{a.router_url}/admin/workers/d1").json()
    assert left["left"] and left["inflight"] == 0
    assert [w["name"] for w in admin.get(f"{a.router_url}/admin/workers").json()["workers"]] == ["p0", "d0"]
    assert admin.get(f"{a.server('p0')['url']}/admin/peers").json()["peers"] == {"d0": a.server("d0")["url"]}
    admin.post(f"{a.router_url}/admin/workers/d0/resume")
    answer(a, tiny_model)  # d0 serves again; d1 gets nothing

    usage = []
    for cycle in range(20):
        admin.post(f"{a.router_url}/admin/workers/d0/drain")
        assert admin.post(f"{a.router_url}/admin/workers", json={"url": d1_url}).status_code == 200
        answer(a, tiny_model)  # through d1: p0 meets it afresh each time
        admin.post(f"{a.router_url}/admin/workers/d0/resume")
        assert admin.delete(f"{a.router_url}/admin/workers/d1").status_code == 200
        if cycle in (4, 19):
            usage.append(prefill_usage(a))
    (rss5, fds5), (rss20, fds20) = usage
    # One ZeroMQ socket (and its monitor) per meeting would add 30 here; ZeroMQ closes a few lazily.
    assert fds20 <= fds5 + 4, (fds5, fds20)
    assert rss20 - rss5 < 16 * 1024, (rss5, rss20)  # KiB
    a.wait_idle(5.0)
    b.wait_idle(5.0)


def test_a_router_launched_with_only_part_of_the_cluster_starts_and_serves_the_other_launchs_servers(
    tmp_path, tiny_model
):
    # One host runs `launch --only p0`, another `launch --only router,d0`: the router reports its own
    # launch (what its launcher waits for) and takes p0 though another launch started it.
    path = make_config(tmp_path, "tiny-1p1d", tiny_model, {"security": {"internal_secret": SECRET}})
    (tmp_path / "p").mkdir()
    (tmp_path / "rd").mkdir()
    p = Cluster(path, tmp_path / "p", only="p0", secret=SECRET)
    try:
        rd = Cluster(path, tmp_path / "rd", only="router,d0", secret=SECRET)
        try:
            health = rd.http.get(f"{rd.router_url}/health").json()
            assert health["launch_id"] == rd.http.get(f"{rd.server('d0')['url']}/health").json()["launch_id"]
            assert health["launch_id"] != p.http.get(f"{p.server('p0')['url']}/health").json()["launch_id"]
            answer(rd, tiny_model)
            assert rd.metric("d0", 'pdserve_request_paths_total{path="remote_kv"}') >= 1  # p0 prefilled it
        finally:
            rd.stop()
    finally:
        p.stop()
