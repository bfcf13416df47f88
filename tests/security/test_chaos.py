"""Chaos under `pdserve launch` with restart on: a 2P2D cluster serves a
bounded mixed load (streamed and not) while random servers are killed with
kill -9 at random moments (each of the four once, in random order, so that
for a while no prefill or no decode server may be left).
Every 200 equals transformers, every failure is a clear error, no request
hangs past the lease, every killed server is restarted and back in rotation,
and once idle no block is reserved or running; stopping the launcher then
stops every process, restarted ones included. The counts are printed and
written to RUN_DIR/chaos.json."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from bench.load.chaos import run as decode_chaos
from tests.support.cluster import Cluster, make_config
from tests.support.oracle import PROMPTS, expected_completion

pytestmark = pytest.mark.integration
MAX_TOKENS = 8
LEASE_S = 10
CLIENTS = 3
SEED = 11


class Load:
    """``CLIENTS`` threads sending requests until stopped; each outcome classified."""

    def __init__(self, url: str, expected: dict[str, str]) -> None:
        self._url, self._expected = url, expected
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.counts = {"correct": 0, "clear_errors": 0, "wrong": 0, "hung": 0}
        self.slowest_s = 0.0
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(LEASE_S + 30)
            assert not t.is_alive()

    def _run(self, index: int) -> None:
        rng = random.Random(SEED + index)
        with httpx.Client(timeout=LEASE_S + 15) as http:
            while not self._stop.is_set():
                prompt, stream = rng.choice(PROMPTS), rng.random() < 0.5
                started = time.monotonic()
                try:
                    outcome = self._one(http, prompt, stream)
                except httpx.TimeoutException:
                    outcome = "hung"
                with self._lock:
                    self.counts[outcome] += 1
                    self.slowest_s = max(self.slowest_s, time.monotonic() - started)

    def _one(self, http: httpx.Client, prompt: str, stream: bool) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
        url = f"{self._url}/v1/completions"
        if not stream:
            resp = http.post(url, json=body)
            if resp.status_code != 200:
                return "clear_errors" if "error" in resp.json() else "wrong"
            return "correct" if resp.json()["choices"][0]["text"] == self._expected[prompt] else "wrong"
        text = ""
        with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                return "clear_errors" if "error" in resp.json() else "wrong"
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return "clear_errors"
                text += event["choices"][0]["text"] if event["choices"] else ""
        return "correct" if text == self._expected[prompt] else "wrong"


def manifest(cluster: Cluster) -> dict:
    return json.loads((cluster.run_dir / "cluster.json").read_text())


def restarts(cluster: Cluster) -> list[dict]:
    path = cluster.run_dir / "restarts.json"
    return json.loads(path.read_text())["restarts"] if path.exists() else []


def wait_back(cluster: Cluster, kills: int, timeout: float = 60.0) -> None:
    """Until ``kills`` restarts happened, each answered /health again, and the router has every worker."""
    deadline = time.monotonic() + timeout
    while True:
        done = [r for r in restarts(cluster) if r["back_after_s"] is not None]
        workers = cluster.http.get(f"{cluster.router_url}/health").json()["workers"]
        if len(done) >= kills and all(w["healthy"] and w["in_rotation"] for w in workers):
            return
        assert time.monotonic() < deadline, f"not back after {timeout} s: {restarts(cluster)}, {workers}"
        time.sleep(0.1)


def test_kill_9_of_random_servers_under_load_costs_no_wrong_answer_and_no_block(tmp_path, tiny_model):
    layout = {
        "prefill": [{"name": f"p{i}", "port": 1, "block_size": 4} for i in range(2)],
        "decode": [
            {"name": f"d{i}", "port": 1, "block_size": 16, "kv_layout": "NHD" if i else "HND"} for i in range(2)
        ],
    }
    config = make_config(
        tmp_path,
        "tiny-1p1d",
        tiny_model,
        {
            **layout,
            "lease_s": LEASE_S,
            "drain_timeout_s": 5,
            "restart": {"backoff_s": 0.2, "max_restarts": 3},
            "router": {"health_interval_s": 0.25, "health_backoff_max_s": 0.5},
        },
    )
    expected = {p: expected_completion(tiny_model, p, MAX_TOKENS)[0] for p in PROMPTS}
    rng = random.Random(SEED)
    cluster = Cluster(config, tmp_path)
    load = Load(cluster.router_url, expected)
    killed: list[str] = []
    try:
        load.start()
        for name in rng.sample(["p0", "p1", "d0", "d1"], 4):
            time.sleep(rng.uniform(0.2, 1.5))  # a random moment of the load, not a synchronisation
            pid = next(p["pid"] for p in manifest(cluster)["processes"] if p["name"] == name)
            os.kill(pid, signal.SIGKILL)
            killed.append(name)
        wait_back(cluster, len(killed))
        load.stop()
        idle_s = cluster.wait_idle(LEASE_S + 5)
        assert cluster.launcher.poll() is None  # nobody stopped the cluster
        summary = {
            "kills": killed,
            **load.counts,
            "leaked_blocks": 0,
            "slowest_request_s": round(load.slowest_s, 2),
            "idle_after_s": round(idle_s, 2),
            "restart_s": [r["back_after_s"] for r in restarts(cluster)],
        }
        (tmp_path / "chaos.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"\nchaos: {summary}")
        assert load.counts["wrong"] == 0 and load.counts["hung"] == 0
        assert load.counts["correct"] > 0
        assert load.slowest_s < LEASE_S + 15
        assert sorted(r["name"] for r in restarts(cluster)) == sorted(killed)
        pids = [p["pid"] for p in manifest(cluster)["processes"]]  # the restarted ones among them
        cluster.launcher.send_signal(signal.SIGTERM)
        assert cluster.launcher.wait(30) == 0
        for pid in pids:  # stopping the launcher still stops every process, restarted or not
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        load._stop.set()
        cluster.stop()


def test_a_decode_server_killed_and_one_drained_under_load_cost_the_clients_nothing(tmp_path):
    """The short CI run of bench/load/chaos.py (2P2D, kill -9 of d0, then d1 drained through the
    router): with migration no client sees an error, none a wrong answer, none hangs, no block
    is left held; the figures are written to RUN_DIR/decode-chaos.json."""
    args = argparse.Namespace(
        code=None,
        clients=3,
        max_tokens=24,
        phase_s=2.0,
        deadline_s=60.0,
        cpus=None,
        run_dir=str(tmp_path),
        # every decode step waits 20 ms: a 24-token stream lasts half a second, so the kill and the drain
        # find streams in flight on their server however fast the engine decodes the tiny model
        step_delay_s=0.02,
    )
    result = decode_chaos(args)
    (tmp_path / "decode-chaos.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\ndecode chaos: {result}")
    assert result["correct"] > 0 and sum(result["migrations"].values()) >= 1
    assert (result["error"], result["wrong"], result["hung"], result["leaked_blocks"]) == (0, 0, 0, 0)
