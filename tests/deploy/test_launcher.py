"""`pdserve launch`: config errors stop it at once; with restarts off, a dying process stops the cluster
(restarts on: tests/security/test_chaos.py); servers whose torch threads outnumber the cores are told to
spin briefly between OpenMP kernels."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from deploy.config import parse_config
from deploy.launcher import openmp_spin
from tests.support.cluster import CONFIGS, REPO, Cluster, _alive, make_config


def test_bad_config_stops_the_launch_with_file_key_and_value(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: tiny\nrouter: {port: 8000, polcy: round_robin}\n"
        "prefill: [{name: p0, port: 8100}]\ndecode: [{name: d0, port: 8200}]\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "launch", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.returncode == 2
    assert f"{bad}: unknown key 'router.polcy' (value 'round_robin')" in proc.stderr


@pytest.mark.integration
def test_with_restarts_off_a_dying_server_stops_the_whole_cluster(tmp_path, tiny_model):
    cluster = Cluster(make_config(tmp_path, "colocated", tiny_model, {"restart": {"policy": "never"}}), tmp_path)
    try:
        manifest = json.loads((tmp_path / "cluster.json").read_text())
        assert {p["role"] for p in manifest["processes"]} == {"colocated", "router"}
        os.kill(cluster.server("c0")["pid"], signal.SIGKILL)
        assert cluster.launcher.wait(20) == 1
        deadline = time.monotonic() + 5
        while any(_alive(p["pid"]) for p in manifest["processes"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p["pid"]) for p in manifest["processes"])
        assert "c0 exited" in (tmp_path / "launcher.log").read_text()
    finally:
        cluster.stop()


def test_openmp_spins_briefly_only_where_threads_outnumber_cores_or_fill_them_beside_the_router(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    short = {"GOMP_SPINCOUNT": "10000"}
    data = yaml.safe_load((CONFIGS / "1p1d.yaml").read_text())  # p0 and d0, engine.num_threads 2
    cluster = parse_config(data, "1p1d.yaml")
    assert openmp_spin(cluster, None, cores=5) == {}  # 2 + 2 threads on 5 cores: one left for the router
    assert openmp_spin(cluster, None, cores=4) == short  # 2 + 2 threads fill 4 cores beside the router
    assert openmp_spin(cluster, None, cores=3) == short
    assert openmp_spin(cluster, {"d0"}, cores=2) == {}  # this host starts d0 alone: its cores are its own
    assert openmp_spin(cluster, {"d0", "router"}, cores=2) == short  # d0 fills them beside the router
    assert openmp_spin(cluster, {"d0", "router"}, cores=3) == {}
    colocated = parse_config(yaml.safe_load((CONFIGS / "colocated.yaml").read_text()), "colocated.yaml")
    assert openmp_spin(colocated, None, cores=2) == short  # the default demo: c0's 2 threads and the router
    unset = parse_config({**data, "engine": {**data["engine"], "num_threads": None}}, "1p1d.yaml")
    assert openmp_spin(unset, {"p0"}, cores=8) == {}  # torch's default: one thread per core
    assert openmp_spin(unset, None, cores=8) == short
    tp = parse_config({**data, "decode": [{**data["decode"][0], "tensor_parallel_size": 2}]}, "1p1d.yaml")
    assert openmp_spin(tp, {"d0"}, cores=3) == short  # two ranks of two threads
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # the operator's choice stands
        monkeypatch.setenv(name, "PASSIVE" if name == "OMP_WAIT_POLICY" else "0")
        assert openmp_spin(cluster, None, cores=1) == {}
        monkeypatch.delenv(name)


def environ(pid: int) -> dict[str, str]:
    entries = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


@pytest.mark.integration
def test_servers_sharing_cores_are_launched_with_a_short_openmp_spin(tmp_path, tiny_model, monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    cores = len(os.sched_getaffinity(0))
    cluster = Cluster(make_config(tmp_path, "tiny-1p1d", tiny_model, {"engine": {"num_threads": cores}}), tmp_path)
    try:
        for server in cluster.servers:
            assert environ(server["pid"]).get("GOMP_SPINCOUNT") == "10000", server["name"]
        router = next(p for p in cluster.manifest["processes"] if p["role"] == "router")
        assert "GOMP_SPINCOUNT" not in environ(router["pid"])
        said = (tmp_path / "launcher.log").read_text()
        assert f"torch threads fill or outnumber this host's {cores} cores: GOMP_SPINCOUNT=10000 for them" in said
    finally:
        cluster.stop()


def cmdline(pid: int) -> list[str]:
    return open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")


@pytest.mark.integration
def test_auto_kv_caches_are_sized_by_the_launcher_for_its_servers_together(tmp_path, tiny_model):
    auto = {"engine": {"kv_cache_bytes": "auto", "num_blocks": None, "max_num_seqs": 4}}
    cluster = Cluster(make_config(tmp_path, "tiny-1p1d", tiny_model, auto), tmp_path)
    try:
        full = 4 * 4096 * 2 * 2 * 2 * 16 * 4  # sequences x tokens x (2 layers, K and V, 2 heads of 16 floats)
        for server in cluster.servers:
            args = cmdline(server["pid"])
            assert args[args.index("--kv-cache-bytes") + 1] == str(full), server["name"]
        blocks = cluster.blocks()
        assert blocks["p0"]["total"] == full // (4 * 2 * 2 * 2 * 16 * 4)  # P's blocks of 4 tokens
        assert blocks["d0"]["total"] == full // (16 * 2 * 2 * 2 * 16 * 4)  # D's of 16
        said = (tmp_path / "launcher.log").read_text()
        assert "pdserve: KV cache (kv_cache_bytes: auto): p0 8 MiB, d0 8 MiB per rank, from " in said
    finally:
        cluster.stop()
