"""`pdserve bench transfer --listen / --peer`: the benchmark with its receiver on
another host (here another process on 127.0.0.1; across namespaces:
bench/micro/multihost_transfer.py and tests/multihost/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.micro.transfer_peer import split_address
from tests.support.cluster import free_ports
from transfer.layout import KVLayout

REPO = Path(__file__).resolve().parents[2]
SHAPE = [
    "--layers",
    "2",
    "--blocks",
    "8",
    "--block-size",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--dtype",
    "float32",
    "--iters",
    "1",
]


def test_split_address_takes_host_and_port_and_refuses_anything_else():
    assert split_address("10.213.0.11:7400") == ("10.213.0.11", 7400)
    assert split_address("[::1]:80") == ("::1", 80)
    assert split_address("d0.example.test:0") == ("d0.example.test", 0)
    for bad in ("10.213.0.11", ":80", "host:", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_address(bad)


@pytest.mark.integration
def test_the_sender_names_the_shape_and_the_listener_serves_one_run_then_exits(tmp_path):
    port = free_ports(1)[0]
    bench = [sys.executable, "-m", "bench.micro.transfer", "--backend", "zmq"]
    with open(tmp_path / "recv.log", "wb") as log:
        receiver = subprocess.Popen(
            [*bench, "--listen", f"127.0.0.1:{port}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=log
        )
    try:
        sender = subprocess.run(
            [*bench, "--peer", f"127.0.0.1:{port}", "--json", *SHAPE],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert sender.returncode == 0, sender.stderr
        assert receiver.wait(30) == 0, (tmp_path / "recv.log").read_text()
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    result = json.loads(sender.stdout)
    layout = KVLayout.for_engine_cache(
        num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype="float32"
    )
    assert result["bytes"] == layout.total_bytes == 2 * 2 * 8 * 4 * 2 * 16 * 4
    assert result["peer"] == f"127.0.0.1:{port}"
    assert result["gbps"] > 0 and result["memcpy_gbps"] > 0
    assert "listening on 127.0.0.1:" in (tmp_path / "recv.log").read_text()
