"""`pdserve launch`: config errors stop it at once; with restarts off, a dying process stops the cluster
(restarts on: tests/security/test_chaos.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.serving.cluster import REPO, Cluster, _alive, make_config


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
