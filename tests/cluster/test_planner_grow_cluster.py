"""A pool that grows: `pdserve launch` with the planner acting and planner.max_instances above the instances
listed starts an added instance when the load asks for more than the pool has, and drains and stops it, by
its pid, when the load falls; the listed instances stay, no request fails and every block comes back."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest
import yaml

from bench.plan.costmodel import StepCost
from bench.plan.profile import Profile
from tests.cluster.test_mock_cluster import MOCK, weightless
from tests.cluster.test_planner_cluster import LongPrompts, decisions
from tests.support.cluster import Cluster, free_ports, make_config
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def start(tmp_path_factory, tiny_model) -> Cluster:
    """1P1D of mock engines whose prefill costs 4 ms a token, the planner acting, at most 3 instances."""
    model = weightless(tiny_model, tmp_path_factory.mktemp("weightless") / "tiny")
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    steps = {1: StepCost(base=0.002, per_token=0.004, per_attn=0.0, per_seq=0.0, per_key=0.0)}
    Profile("tiny", "float32", "cpu", 2, 64, steps, {1: 0.0}, 1e9, 1e-4, "test").save(profile)
    folder = tmp_path_factory.mktemp("grow")
    planner = {"mode": "act", "interval_s": 1.0, "window_s": 4.0, "confirm": 2, "cooldown_s": 0}
    planner |= {"ttft_s": 5.0, "tpot_s": 0.5, "profile": str(profile), "max_instances": 3}
    changes = {**MOCK, "engine": {**MOCK["engine"], "mock_profile": str(profile)}, "planner": planner}
    # a queue of long prompts at one prefill server on a busy machine can outlast the default lease: that is
    # not what this test is about
    changes |= {"router": {"local_prefill_threshold": 0}, "lease_s": 60}
    config = make_config(folder, "tiny-1p1d", model, changes)
    data = yaml.safe_load(config.read_text())
    taken = {data["router"]["port"]} | {i[k] for i in data["prefill"] + data["decode"] for k in ("port", "kv_port")}
    data["planner"]["port"] = next(p for p in iter(lambda: free_ports(1)[0], None) if p not in taken)
    config.write_text(yaml.safe_dump(data))
    c = Cluster(config, folder)
    c.planner_url = f"http://127.0.0.1:{data['planner']['port']}"
    return c


class ShortPrompts:
    """One client sending short prompts for 2 tokens until stopped: a light load the planner still sees."""

    def __init__(self, c: Cluster) -> None:
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.client = c.client()
        self.thread = threading.Thread(target=self._send)

    def _send(self) -> None:
        while not self.stop.is_set():
            try:
                r = self.client.completions.create(model="tiny", prompt="one two", max_tokens=2, temperature=0)
                assert r.usage.completion_tokens == 2
            except Exception as exc:  # every failure is reported by the test
                self.failures.append(repr(exc))

    def __enter__(self) -> ShortPrompts:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


def workers(c: Cluster) -> dict[str, dict]:
    return {w["name"]: w for w in c.http.get(f"{c.router_url}/admin/workers").json()["workers"]}


def launched(c: Cluster) -> dict[str, dict]:
    """The launcher's processes now, by name (its manifest, rewritten as it starts and stops them)."""
    return {p["name"]: p for p in json.loads((c.run_dir / "cluster.json").read_text())["processes"]}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_launcher_starts_an_instance_the_planner_asks_for_and_stops_it_by_pid_when_the_load_falls(
    tmp_path_factory, tiny_model
):
    c = start(tmp_path_factory, tiny_model)
    added_pid = None
    try:
        with LongPrompts(c) as heavy:
            wait_until(lambda: "added-1" in workers(c) and workers(c)["added-1"]["in_rotation"], timeout=120)
            added = launched(c)["added-1"]
            added_pid = added["pid"]
            assert workers(c)["added-1"]["role"] == "prefill" and added["role"] == "prefill"
            served = f"{added['url']}/metrics"
            wait_until(lambda: 'pdserve_requests_total{outcome="ok"}' in httpx.get(served, timeout=5).text, 60)
        asked = [d for d in decisions(c) if d["action"] == "scale"]
        assert asked[0]["carried_out"] == "asked the launcher to start a prefill server"
        assert (asked[0]["prefill"], asked[0]["decode"]) == (2, 1) and asked[0]["instances"]["prefill"] == 1
        with ShortPrompts(c) as light:
            wait_until(lambda: "added-1" not in workers(c), timeout=120)
            wait_until(lambda: not alive(added_pid), timeout=60)
        assert heavy.failures == [] and light.failures == [] and heavy.answers > 0
        assert "added-1" not in launched(c) and sorted(workers(c)) == ["d0", "p0"]
        stop = next(d for d in decisions(c) if d["carried_out"] == "asked the launcher to stop a prefill server")
        assert (stop["prefill"], stop["decode"]) == (1, 1)
        log = (c.run_dir / "launcher.log").read_text()
        assert "pdserve: stopping prefill added-1: the planner asked for one fewer" in log
        c.wait_idle(10.0)
        assert all(b["free"] == b["total"] for b in c.blocks().values())
    finally:
        c.stop()
        if added_pid is not None and alive(added_pid):  # the launcher stops it; a pid left is killed here
            os.kill(added_pid, 9)
