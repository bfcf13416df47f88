"""A decode server frozen (SIGSTOP) with streams open on a real 1P1D: each stream ends within
router.stream_stall_s with a clear error instead of hanging, the server leaves rotation, and once it
runs again (SIGCONT) it is back in rotation, answers exactly and holds no block. While it runs, a
live server's streams never stall, however long a request waits: it sends a heartbeat."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.support.cluster import Cluster, make_config
from tests.support.oracle import expected_completion
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
STALL_S = 3
STREAMS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("frozen")
    cluster = Cluster(make_config(folder, "tiny-1p1d", tiny_model, {"router": {"stream_stall_s": STALL_S}}), folder)
    yield cluster
    cluster.stop()


class Stream(threading.Thread):
    """A long streamed completion; ``started`` is set at its first token; ``outcome`` at its end."""

    def __init__(self, url: str, i: int) -> None:
        super().__init__(daemon=True)
        self.url, self.i = url, i
        self.started = threading.Event()
        self.outcome: str | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": f"stream {self.i}",
            "max_tokens": 3000,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        self.outcome = f"error: {event['error']['message']}"
                        break
                    self.started.set()
                else:
                    self.outcome = f"ended, status {r.status_code}"
        except httpx.TimeoutException:
            self.outcome = "hung"
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


def router_view(cluster: Cluster, name: str) -> dict:
    workers = httpx.get(f"{cluster.router_url}/health", timeout=10).json()["workers"]
    return next(w for w in workers if w["name"] == name)


def test_a_frozen_decode_servers_streams_fail_within_the_stall_time_and_it_leaves_rotation(cluster, tiny_model):
    d0 = cluster.server("d0")
    streams = [Stream(cluster.router_url, i) for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60)
    assert all(s.outcome is None for s in streams), [s.outcome for s in streams]  # all still streaming
    os.kill(d0["pid"], signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        for s in streams:
            s.join(STALL_S + 30)
        waited = [round(s.ended_at - frozen_at, 1) for s in streams]
        print(
            f"{STREAMS} streams on a frozen d0 ended after {waited} s (stall {STALL_S} s): "
            f"{[s.outcome for s in streams]}"
        )
        assert all(s.outcome and s.outcome.startswith("error") for s in streams), [s.outcome for s in streams]
        assert all("d0" in s.outcome and "timed out" in s.outcome for s in streams), [s.outcome for s in streams]
        assert max(waited) < STALL_S + 5
        wait_until(lambda: not router_view(cluster, "d0")["healthy"], 30, "d0 out of rotation")
        refused = httpx.post(
            f"{cluster.router_url}/v1/completions",
            timeout=30,
            json={"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0},
        )
        assert refused.status_code == 503, refused.text  # no decode server in rotation: said at once
    finally:
        os.kill(d0["pid"], signal.SIGCONT)
    wait_until(lambda: router_view(cluster, "d0")["in_rotation"], 30, "d0 back in rotation")
    out = cluster.client(timeout=60).completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert (out.choices[0].text, out.usage.completion_tokens) == expected_completion(tiny_model, "hello", 4)
    cluster.wait_idle(10.0)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values()), cluster.blocks()


def test_a_live_decode_server_keeps_a_silent_stream_open_past_the_stall_time_with_heartbeats(cluster, tiny_model):
    # A reservation whose prefill never comes: d0 has nothing to say until the 10 s lease expires (the
    # router would then have the prompt prefilled again); meanwhile its heartbeats keep the stream open.
    d0 = cluster.server("d0")
    body = {"request_id": "silent", "prompt_token_ids": list(range(3, 40)), "sampling": {"max_tokens": 2}}
    events, times = [], []
    start = time.monotonic()
    with cluster.http.stream("POST", f"{d0['url']}/generate", json=body, timeout=30) as r:  # with the secret
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.strip():
                events.append(json.loads(line))
                times.append(time.monotonic() - start)
    gaps = [b - a for a, b in zip(times, times[1:])]
    kinds = [e["type"] for e in events]
    print(f"a reservation left unfilled: {kinds.count('alive')} heartbeats, longest gap {max(gaps):.2f} s")
    assert kinds[0] == "reservation" and set(kinds[1:-1]) == {"alive"}
    assert (events[-1]["type"], events[-1]["code"]) == ("error", "lease_expired")
    assert kinds.count("alive") >= STALL_S and max(gaps) < STALL_S  # never silent for a stall
    assert times[-1] > STALL_S
    cluster.wait_idle(10.0)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values()), cluster.blocks()
