"""The planner's actuators (deploy/planner_act.py). No Kubernetes API server runs on these machines: the
scale subresource is a small HTTP stand-in on 127.0.0.1 that answers as the API server does
(autoscaling/v1 Scale), and the official client talks to it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.planner import Decision
from deploy.planner_act import ActError, InstanceScale, PoolSwitch
from deploy.planner_signals import WorkerView

SCALE = "/apis/apps/v1/namespaces/{ns}/statefulsets/{name}/scale"


class StandIn:
    """StatefulSets' scale subresource: GET answers the Scale, PATCH merges spec.replicas; every call kept."""

    def __init__(self, replicas: dict[str, int], namespace: str = "llm") -> None:
        self.replicas = dict(replicas)
        self.calls: list[tuple[str, str, str, dict | None]] = []  # method, path, content type, body
        paths = {SCALE.format(ns=namespace, name=n): n for n in replicas}
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, name: str | None) -> None:
                if name is None:
                    self.send_response(404)
                    body = {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
                else:
                    self.send_response(200)
                    body = {
                        "apiVersion": "autoscaling/v1",
                        "kind": "Scale",
                        "metadata": {"name": name, "namespace": namespace},
                        "spec": {"replicas": stand_in.replicas[name]},
                        "status": {"replicas": stand_in.replicas[name]},
                    }
                data = json.dumps(body).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                stand_in.calls.append(("GET", self.path, "", None))
                self._answer(paths.get(self.path))

            def do_PATCH(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                stand_in.calls.append(("PATCH", self.path, self.headers["Content-Type"], body))
                name = paths.get(self.path)
                if name is not None:
                    stand_in.replicas[name] = body["spec"]["replicas"]
                self._answer(name)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    with StandIn({"pd-p0": 1, "pd-p1": 0, "pd-p2": 0, "pd-d0": 1, "pd-d1": 1}) as s:
        yield s


INSTANCES = {"prefill": ["pd-p0", "pd-p1", "pd-p2"], "decode": ["pd-d0", "pd-d1"]}


def scaler(stand_in: StandIn, instances=None) -> InstanceScale:
    from kubernetes import client

    return InstanceScale("llm", instances or INSTANCES, client.ApiClient(client.Configuration(host=stand_in.url)))


def test_a_role_of_n_runs_its_first_n_instances_and_only_changed_ones_are_patched(stand_in):
    s = scaler(stand_in)
    assert s.replicas() == {"pd-p0": 1, "pd-p1": 0, "pd-p2": 0, "pd-d0": 1, "pd-d1": 1}
    stand_in.calls.clear()
    assert s.apply(Decision(0.0, "scale", prefill=3, decode=1, reason="r")) == {"pd-p1": 1, "pd-p2": 1, "pd-d1": 0}
    patches = [(c[1].split("/")[-2], c[2], c[3]) for c in stand_in.calls if c[0] == "PATCH"]
    merge = "application/strategic-merge-patch+json"
    assert patches == [
        ("pd-p1", merge, {"spec": {"replicas": 1}}),
        ("pd-p2", merge, {"spec": {"replicas": 1}}),
        ("pd-d1", merge, {"spec": {"replicas": 0}}),
    ]
    assert stand_in.replicas == {"pd-p0": 1, "pd-p1": 1, "pd-p2": 1, "pd-d0": 1, "pd-d1": 0}
    assert s.apply(Decision(1.0, "scale", prefill=3, decode=1, reason="r")) == {}


def test_more_than_the_named_instances_or_an_unknown_one_is_an_act_error(stand_in):
    with pytest.raises(ActError, match="more than the instances the config names"):
        scaler(stand_in).apply(Decision(0.0, "scale", prefill=4, decode=1, reason="r"))
    assert not [c for c in stand_in.calls if c[0] == "PATCH"]
    with pytest.raises(ActError, match="reading the instances' scale: .*404"):
        scaler(stand_in, {"prefill": ["pd-p0"], "decode": ["nope"]}).replicas()


class Router:
    """The router's role route as the planner calls it: the calls kept, the answer scripted."""

    def __init__(self, status: int) -> None:
        self.calls: list[tuple[str, str, dict | None]] = []
        router = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                router.calls.append((self.path, self.headers.get("Authorization", ""), body))
                answer = (
                    {"name": "d1", "seconds": 1.25}
                    if status == 200
                    else {"error": {"message": "a switch is in flight"}}
                )
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


WORKERS = [
    WorkerView("p0", "prefill", True, 0),
    WorkerView("d0", "decode", True, 5),
    WorkerView("d1", "decode", True, 2),
    WorkerView("d2", "decode", False, 0),  # draining: not a donor
]


def test_a_switch_takes_the_least_busy_donor_in_rotation_and_names_the_route():
    router = Router(200)
    try:
        switch = PoolSwitch(router.url, "s3cret")
        assert switch.apply(Decision(0.0, "switch", 2, 2, "r", switch_to="prefill"), WORKERS) == ("d1", 1.25)
        assert router.calls == [("/admin/workers/d1/role", "Bearer s3cret", {"role": "prefill"})]
        with pytest.raises(ActError, match="no prefill server in rotation to become decode"):
            switch.apply(Decision(0.0, "switch", 0, 4, "r", switch_to="decode"), WORKERS[1:])
        switch.close()
    finally:
        router.close()


def test_several_donors_are_the_least_busy_and_drain_and_resume_name_their_routes():
    router = Router(200)
    try:
        switch = PoolSwitch(router.url, "s3cret")
        assert [w.name for w in switch.donors(WORKERS, "prefill", 3)] == ["d1", "d0"]  # d2 is out of rotation
        assert [w.name for w in switch.donors(WORKERS, "decode", 2)] == ["p0"]
        switch.drain(["d1", "d0"])
        switch.resume("d1")
        assert switch.switch("d1", "prefill") == 1.25
        assert [(path, body) for path, _, body in router.calls] == [
            ("/admin/workers/drain", {"names": ["d1", "d0"]}),
            ("/admin/workers/d1/resume", None),
            ("/admin/workers/d1/role", {"role": "prefill"}),
        ]
        switch.close()
    finally:
        router.close()


def test_a_refused_switch_is_an_act_error_with_the_routers_answer():
    router = Router(409)
    try:
        switch = PoolSwitch(router.url, None)
        with pytest.raises(ActError, match="switching d1 to prefill: 409 .*in flight"):
            switch.apply(Decision(0.0, "switch", 2, 2, "r", switch_to="prefill"), WORKERS)
        assert router.calls[0][1] == ""
        switch.close()
    finally:
        router.close()
