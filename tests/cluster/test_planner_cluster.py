"""The planner as `pdserve launch` starts it (planner.mode recommend), over a 1P3D cluster of mock engines
whose prefill is slow: under long prompts it wants decode servers to become prefill servers, says why in
/decisions and in its metrics, and, recommending only, leaves the roles as they are."""

from __future__ import annotations

import threading

import httpx
import pytest
import yaml

from bench.plan.costmodel import StepCost
from bench.plan.profile import Profile
from tests.cluster.test_mock_cluster import MOCK, weightless
from tests.support.cluster import Cluster, free_ports, make_config
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PROMPT = "one two three four five six seven eight " * 40  # about 320 tokens: 1.3 s of prefill a prompt


def start(tmp_path_factory, tiny_model, mode: str, max_moves: int = 1) -> Cluster:
    """1P3D of mock engines whose prefill costs 4 ms a token, with the planner in ``mode``: a prompt's prefill
    takes long beside what a loaded machine adds to a request, so the prefill server is busy all the time."""
    model = weightless(tiny_model, tmp_path_factory.mktemp("weightless") / "tiny")
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    steps = {1: StepCost(base=0.002, per_token=0.004, per_attn=0.0, per_seq=0.0, per_key=0.0)}
    Profile("tiny", "float32", "cpu", 2, 64, steps, {1: 0.0}, 1e9, 1e-4, "test").save(profile)
    folder = tmp_path_factory.mktemp("planner")
    planner = {"mode": mode, "interval_s": 1.0, "window_s": 4.0, "confirm": 2, "cooldown_s": 0, "max_moves": max_moves}
    planner |= {"ttft_s": 5.0, "tpot_s": 0.5, "profile": str(profile)}
    decode = [{"name": f"d{k}", "block_size": 16} for k in range(3)]
    changes = {**MOCK, "engine": {**MOCK["engine"], "mock_profile": str(profile)}, "planner": planner}
    changes |= {"decode": decode, "router": {"local_prefill_threshold": 0}}
    # The one prefill server is overloaded on purpose until the planner moves a decode server to it: on a
    # busy machine a prompt can wait past the default 10 s lease before it is computed, and its request then
    # fails for that, not for anything the planner did (as in test_planner_grow_cluster.py).
    changes["lease_s"] = 60
    config = make_config(folder, "tiny-1p1d", model, changes)
    data = yaml.safe_load(config.read_text())
    taken = {data["router"]["port"]} | {i[k] for i in data["prefill"] + data["decode"] for k in ("port", "kv_port")}
    port = next(p for p in iter(lambda: free_ports(1)[0], None) if p not in taken)  # free and not the cluster's
    data["planner"]["port"] = port
    config.write_text(yaml.safe_dump(data))
    c = Cluster(config, folder)
    c.planner_url = f"http://127.0.0.1:{port}"
    return c


@pytest.fixture(scope="module")
def planned(tmp_path_factory, tiny_model):
    c = start(tmp_path_factory, tiny_model, "recommend")
    yield c
    c.stop()


class LongPrompts:
    """Clients sending long prompts for 2 tokens each until stopped; what failed is kept."""

    def __init__(self, c: Cluster, clients: int = 4) -> None:
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.answers = 0
        self.client = c.client()
        self.threads = [threading.Thread(target=self._send) for _ in range(clients)]

    def _send(self) -> None:
        while not self.stop.is_set():
            try:
                r = self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
                assert r.usage.completion_tokens == 2
                self.answers += 1
            except Exception as exc:  # every failure is reported by the test
                self.failures.append(repr(exc))

    def __enter__(self) -> LongPrompts:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def decisions(c: Cluster) -> list[dict]:
    return httpx.get(f"{c.planner_url}/decisions", timeout=5).json()["decisions"]


def test_long_prompts_make_the_planner_want_prefill_servers_and_recommending_changes_nothing(planned):
    assert httpx.get(f"{planned.planner_url}/health", timeout=5).json()["instance"] == "planner"
    with LongPrompts(planned) as load:
        wait_until(lambda: any(d["action"] == "switch" for d in decisions(planned)), timeout=60)
        # four clients, one prefill server: prompts queue there, and the planner reads it off the router
        wait_until(lambda: any(d["load"]["queued_tokens"] > 0 for d in decisions(planned)), timeout=60)
    assert load.failures == []
    made = decisions(planned)
    first = next(i for i, d in enumerate(made) if d["action"] == "switch")
    switch = made[first]
    assert switch["switch_to"] == "prefill" and (switch["prefill"], switch["decode"]) == (2, 2)
    assert switch["instances"] == {"prefill": 1, "decode": 3} and switch["carried_out"] is None
    assert switch["utilisation"]["prefill"] > switch["utilisation"]["decode"]
    assert switch["load"]["prompt_tokens"] > 0 and "busiest role" in switch["reason"]
    assert made[first - 1]["reason"].startswith("wanted 1/2")  # confirmed over two windows first
    metrics = httpx.get(f"{planned.planner_url}/metrics", timeout=5).text
    assert 'pdserve_planner_decisions_total{action="switch"}' in metrics
    assert 'pdserve_planner_instances{role="decode"} 3.0' in metrics
    assert "pdserve_planner_prefill_queued_tokens " in metrics and "pdserve_planner_waiting_requests " in metrics
    workers = planned.http.get(f"{planned.router_url}/admin/workers").json()["workers"]
    assert sorted((w["name"], w["role"]) for w in workers) == [
        ("d0", "decode"),
        ("d1", "decode"),
        ("d2", "decode"),
        ("p0", "prefill"),
    ]
    planned.wait_idle(5.0)
    assert all(b["free"] == b["total"] for b in planned.blocks().values())


def test_acting_the_planner_switches_decode_servers_to_prefill_under_load_and_fails_nothing(
    tmp_path_factory, tiny_model
):
    # up to two moves a decision: the long prompts want 3P1D, two away, so one decision drains two decode
    # servers together (POST /admin/workers/drain) and switches them one after the other
    c = start(tmp_path_factory, tiny_model, "act", max_moves=2)
    try:
        with LongPrompts(c) as load:
            wait_until(lambda: any((d["carried_out"] or "").startswith("switched") for d in decisions(c)), 90)
        carried = [d["carried_out"] for d in decisions(c) if d["carried_out"]]
        made = [(d["action"], d["reason"], d["carried_out"]) for d in decisions(c)]
        switches = [one for d in carried for one in d.split("; ")]
        assert switches and all(d.startswith("switched d") and " to prefill in " in d for d in switches), made
        assert any(
            d["moves"] == 2 and d["carried_out"].count("switched") == 2 for d in decisions(c) if d["carried_out"]
        ), made
        workers = c.http.get(f"{c.router_url}/admin/workers").json()["workers"]
        roles = sorted(w["role"] for w in workers if w["in_rotation"])
        assert roles.count("prefill") == 1 + len(switches) and len(roles) == 4
        assert load.failures == [] and load.answers > 0
        c.wait_idle(10.0)
        assert all(b["free"] == b["total"] for b in c.blocks().values())
    finally:
        c.stop()
