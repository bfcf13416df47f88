"""Live role switching (deploy/role_server.py, the router's POST /admin/workers/{name}/role) on a
2P2D tiny cluster of real processes: under a steady load of greedy requests a prefill server
becomes a decode server and back, and a decode server a prefill server and back, with no failed
request, every answer the transformers greedy reference, and every KV block back on every server
after; each switch's time is printed. Bad input: 404, 400, and 409 for a switch that would leave
no decode server. A server killed (SIGKILL) after a switch is started again by the launcher in
the role it was switched to (its role file, deploy/role_file.py), in the epoch after, and the
router puts it back in rotation in that role: it serves the greedy reference, and every block is
back."""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time

import pytest

from tests.support.cluster import MAX_MODEL_LEN, THRESHOLD, start_cluster
from tests.support.oracle import PROMPTS, expected_completion
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 16
CLIENTS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    c = start_cluster(
        tmp_path_factory,
        "2p2d",
        tiny_model,
        {"max_model_len": MAX_MODEL_LEN, "router": {"local_prefill_threshold": THRESHOLD}},
    )
    yield c
    c.stop()


class Load:
    """``CLIENTS`` threads sending greedy completions of ``PROMPTS`` in turn until stopped."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.stop = threading.Event()
        self.answers: list[tuple[str, str, int]] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(CLIENTS)]

    def _run(self, k: int) -> None:
        client, i = self.cluster.client(), k
        while not self.stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
                self.answers.append((prompt, out.choices[0].text, out.usage.completion_tokens))
            except Exception as exc:  # every failure is reported by the test
                self.failures.append(repr(exc))
            i += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def switch(cluster, name: str, role: str) -> dict:
    resp = cluster.http.post(f"{cluster.router_url}/admin/workers/{name}/role", json={"role": role}, timeout=90)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (body["name"], body["role"], body["in_rotation"]) == (name, {"colocated": "decode"}.get(role, role), True)
    return body


def served(cluster, name: str, role: str) -> float:
    """What ``name`` did in its current role (its service's counters start at 0 with each role)."""
    if role == "decode":
        return cluster.metric(name, 'pdserve_request_paths_total{path="remote_kv"}')
    return cluster.metric(name, "pdserve_transfer_bytes_total")


def all_blocks_back(cluster) -> bool:
    return all(b["free"] == b["total"] and not b["reserved"] and not b["running"] for b in cluster.blocks().values())


def test_switching_roles_under_load_fails_nothing_and_answers_the_greedy_reference(cluster, tiny_model):
    expected = {p: expected_completion(tiny_model, p, MAX_TOKENS) for p in PROMPTS}
    seconds = []
    with Load(cluster) as load:
        wait_until(lambda: len(load.answers) >= 6, 60, "the load is running")
        for name, role in [("p1", "decode"), ("p1", "prefill"), ("d1", "prefill"), ("d1", "decode")]:
            body = switch(cluster, name, role)
            seconds.append(body["seconds"])
            health = cluster.http.get(f"{cluster.server(name)['url']}/health").json()
            assert (health["role"], health["role_epoch"]) == (role, body["role_epoch"])
            # it serves in its new role while the load runs
            wait_until(lambda n=name, r=role: served(cluster, n, r) >= 2, 60, f"{name} serves as a {role} server")
        before = len(load.answers)
        wait_until(lambda: len(load.answers) >= before + 6, 60, "the load goes on after the last switch")
    assert load.failures == []
    wrong = [(p, text, n) for p, text, n in load.answers if (text, n) != expected[p]]
    assert wrong == [] and len(load.answers) > 20
    wait_until(lambda: all_blocks_back(cluster), 10, "every KV block is back on every server")
    roles = {
        w["name"]: (w["role"], w["role_epoch"])
        for w in cluster.http.get(f"{cluster.router_url}/admin/workers").json()["workers"]
    }
    assert roles == {"p0": ("prefill", 0), "p1": ("prefill", 2), "d0": ("decode", 0), "d1": ("decode", 2)}
    print(f"switch seconds under load: {seconds}, p50 {statistics.median(seconds):.3f}")
    assert max(seconds) < 10


def test_bad_switches_are_refused_with_the_reason(cluster, tiny_model):
    url = f"{cluster.router_url}/admin/workers"
    unknown = cluster.http.post(f"{url}/zz/role", json={"role": "decode"})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "unknown_worker")
    bad_role = cluster.http.post(f"{url}/p1/role", json={"role": "router"})
    assert (bad_role.status_code, bad_role.json()["error"]["code"]) == (400, "unknown_role")
    unauthorized = cluster.http.post(f"{url}/p1/role", json={"role": "decode"}, headers={"authorization": ""})
    assert unauthorized.status_code == 401
    switch(cluster, "d1", "prefill")
    last = cluster.http.post(f"{url}/d0/role", json={"role": "prefill"})
    assert (last.status_code, last.json()["error"]["code"]) == (409, "no_decode_left")
    assert "last decode server" in last.json()["error"]["message"]
    switch(cluster, "d1", "decode")
    out = cluster.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert (out.choices[0].text, out.usage.completion_tokens) == expected_completion(tiny_model, PROMPTS[0], MAX_TOKENS)
    wait_until(lambda: all_blocks_back(cluster), 10, "every KV block is back on every server")


def pid_of(cluster, name: str) -> int:
    """``name``'s pid now, from the run folder's manifest (the launcher rewrites it on each restart)."""
    processes = json.loads((cluster.run_dir / "cluster.json").read_text())["processes"]
    return next(p["pid"] for p in processes if p["name"] == name)


def in_rotation_as(cluster, name: str) -> tuple[str, int] | None:
    """The role and role epoch the router routes to ``name`` in; None while it is out of rotation."""
    workers = cluster.http.get(f"{cluster.router_url}/admin/workers").json()["workers"]
    worker = next(w for w in workers if w["name"] == name)  # known all along, also while it joins again
    return (worker["role"], worker["role_epoch"]) if worker["in_rotation"] else None


@pytest.mark.parametrize(("name", "role", "back"), [("p1", "decode", "prefill"), ("d1", "prefill", "decode")])
def test_a_server_killed_after_a_switch_comes_back_in_its_switched_role_and_serves(
    cluster, tiny_model, name, role, back
):
    expected = {p: expected_completion(tiny_model, p, MAX_TOKENS) for p in PROMPTS}
    epoch = switch(cluster, name, role)["role_epoch"]
    record = json.loads((cluster.run_dir / "roles" / f"{name}.json").read_text())
    assert (record["instance"], record["role"], record["role_epoch"]) == (name, role, epoch)
    killed, started = pid_of(cluster, name), time.monotonic()
    os.kill(killed, signal.SIGKILL)  # its supervisor starts it again, in the role it recorded

    def restarted() -> bool:
        path = cluster.run_dir / "restarts.json"
        done = json.loads(path.read_text())["restarts"] if path.exists() else []
        return any(r["name"] == name and r["pid"] != killed and r["back_after_s"] is not None for r in done)

    wait_until(restarted, 90, f"the launcher restarted {name}")
    health = cluster.http.get(f"{cluster.server(name)['url']}/health").json()
    assert (health["role"], health["role_epoch"]) == (role, epoch + 1)  # a new life: the epoch after
    wait_until(
        lambda: in_rotation_as(cluster, name) == (role, epoch + 1),
        30,
        f"the router has {name} in rotation as a {role} server again",
    )
    print(f"{name} killed as a {role} server: in rotation again as one after {time.monotonic() - started:.1f} s")
    with Load(cluster) as load:
        wait_until(lambda: served(cluster, name, role) >= 2, 60, f"{name} serves as a {role} server again")
        before = len(load.answers)
        wait_until(lambda: len(load.answers) >= before + 3, 60, "the load goes on")
    assert load.failures == []
    wrong = [(p, text, n) for p, text, n in load.answers if (text, n) != expected[p]]
    assert wrong == [] and load.answers
    wait_until(lambda: all_blocks_back(cluster), 10, "every KV block is back on every server")
    assert switch(cluster, name, back)["role_epoch"] == epoch + 2  # switched as any other server
    wait_until(lambda: all_blocks_back(cluster), 10, "every KV block is back on every server")


def test_a_reservation_from_an_earlier_role_epoch_is_refused_not_served(cluster):
    d1, p0 = cluster.server("d1")["url"], cluster.server("p0")["url"]
    epoch = cluster.http.get(f"{d1}/health").json()["role_epoch"]
    prompt = [100 + i for i in range(40)]
    body = {"request_id": "stale-1", "prompt_token_ids": prompt, "sampling": {"max_tokens": 4, "temperature": 0}}
    with cluster.http.stream("POST", f"{d1}/generate", json=body) as resp:  # leaving it cancels the reservation
        first = json.loads(next(resp.iter_lines()))
    assert resp.status_code == 200, first
    reservation = first["reservation"]
    assert reservation["role_epoch"] == epoch
    switch(cluster, "d1", "prefill")  # the prefill servers forget d1 ...
    switch(cluster, "d1", "decode")  # ... and meet it afresh: the handshake carries the reservation's epoch
    stale = cluster.http.post(f"{p0}/prefill", json={**body, "reservation": reservation})
    assert (stale.status_code, stale.json()["code"]) == (409, "stale_reservation")
    assert "left the role epoch of the reservation (stale_epoch)" in stale.json()["error"]
    wait_until(lambda: all_blocks_back(cluster), 10, "every KV block is back on every server")
