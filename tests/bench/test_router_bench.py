"""``pdserve bench router --against``: two routers, from two checkouts, in front of the same stubs; and
``--replicas``: one router against several behind HAProxy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.micro import router_bench
from bench.micro.stub_cluster import REPO

NO_HAPROXY = "haproxy is not installed (the Debian package haproxy; .ci/run installs it)"


def test_against_runs_both_routers_on_the_same_stubs_and_stops_them(tmp_path: Path):
    other = tmp_path / "other"  # a second checkout: a copy of this tree (what git tracks or would)
    other.mkdir()
    listed = ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    archive = subprocess.run(listed, capture_output=True, check=True).stdout
    files = [f for f in archive.decode().split("\0") if f]
    subprocess.run(["tar", "-C", str(REPO), "-cf", str(tmp_path / "t.tar"), *files], check=True)
    subprocess.run(["tar", "-C", str(other), "-xf", str(tmp_path / "t.tar")], check=True)
    init = other / "router" / "__init__.py"  # the other checkout's router leaves a mark when imported
    init.write_text(init.read_text() + "\nopen(__file__.replace('__init__.py', 'imported'), 'w').close()\n")

    out = tmp_path / "r.json"
    keep = tmp_path / "run"
    argv = ["--against", str(other), "--tokens", "6", "--token-delay", "0.002", "--concurrency", "2"]
    # /proc's CPU times count whole clock ticks (10 ms): each phase must cost the router several, or its
    # CPU reads 0 (three requests at about 1.7 ms each did, now and then)
    argv += ["--requests", "20", "--concurrent-requests", "24", "--warmup", "1", "--rounds", "2"]
    argv += ["--json", str(out), "--keep", str(keep)]
    assert router_bench.main(argv) == 0

    result = json.loads(out.read_text())
    assert set(result["routers"]) == {"this", "against"}
    for side in result["routers"].values():
        assert side["errors"] == 0
        assert len(side["cpu_us_per_token"]) == 2 and all(v > 0 for v in side["cpu_us_per_token"])
        assert side["requests_per_s_median"] > 0 and side["of_direct"] > 0 and side["cpu_ms_per_request_c1"] > 0
        assert side["added_p50_ms"] == side["added_p50_ms"]  # measured (not NaN): the stub's and the router's
    assert result["direct_requests_per_s_median"] > 0
    assert (other / "router" / "imported").exists() and not (REPO / "router" / "imported").exists()
    logs = sorted(p.name for p in keep.glob("*.log"))
    assert logs == ["against.log", "d0.log", "p0.log", "router.log"]
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                cwd = os.readlink(pid_dir / "cwd")
            except OSError:
                continue
            assert cwd != str(other), f"process {pid_dir.name} still runs from the other checkout"


@pytest.mark.skipif(shutil.which("haproxy", path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None, reason=NO_HAPROXY)
def test_replicas_runs_one_router_and_two_behind_haproxy_on_the_same_stubs(tmp_path: Path):
    out = tmp_path / "r.json"
    keep = tmp_path / "run"
    # enough requests that each router's CPU is several of /proc's 10 ms ticks, never a truncated 0
    argv = ["--replicas", "2", "--tokens", "6", "--concurrency", "4", "--concurrent-requests", "48"]
    argv += ["--warmup", "2", "--rounds", "2", "--json", str(out), "--keep", str(keep)]
    assert router_bench.main(argv) == 0

    result = json.loads(out.read_text())
    assert set(result["sides"]) == {"1 router", "2 routers"}
    for side in result["sides"].values():
        assert side["errors"] == 0 and len(side["requests_per_s"]) == 2 and all(v > 0 for v in side["requests_per_s"])
        assert side["routers_cpu_ms_per_request"] > 0
    assert result["sides"]["2 routers"]["haproxy_cpu_ms_per_request"] >= 0
    ratio = result["sides"]["2 routers"]["requests_per_s_median"] / result["sides"]["1 router"]["requests_per_s_median"]
    assert result["requests_per_s_ratio"] == round(ratio, 3)
    config = (keep / "haproxy.cfg").read_text()
    assert config.count("server router-") == 2 and "balance leastconn" in config
    logs = sorted(p.name for p in keep.glob("*.log"))
    assert logs == ["d0.log", "haproxy.log", "p0.log", "replica-0.log", "replica-1.log", "router.log"]
