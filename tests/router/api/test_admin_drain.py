"""The router's admin route that drains several workers at once (router/admin.py): every one is out of
rotation before the first one's streams move, so none moves onto another of them; an unknown name is a
404 before any is drained."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from router.admin import add_admin_routes
from router.cluster.registry import Worker, WorkerRegistry
from router.errors import install_error_handlers


def app_with(registry: WorkerRegistry, moved: list[tuple[str, list[str]]]) -> FastAPI:
    """The admin routes over ``registry``; ``move_off`` records each name with the decode servers in rotation
    then (where its streams could go)."""

    def allow(request: Request) -> None:
        pass

    def move_off(name: str) -> int:
        moved.append((name, [w.name for w in registry.healthy("decode")]))
        return 0

    app = FastAPI()
    install_error_handlers(app)
    add_admin_routes(app, registry, allow, lambda: None, move_off)  # type: ignore[arg-type,return-value]
    return app


def registry() -> WorkerRegistry:
    decode = [Worker(f"d{k}", "decode", f"http://d{k}") for k in range(4)]
    return WorkerRegistry([Worker("p0", "prefill", "http://p0"), *decode])


def test_several_workers_leave_rotation_before_any_ones_streams_move():
    workers, moved = registry(), []
    with TestClient(app_with(workers, moved)) as c:
        answer = c.post("/admin/workers/drain", json={"names": ["d1", "d2", "d1"]})
    assert answer.status_code == 200
    assert [(w["name"], w["in_rotation"]) for w in answer.json()["workers"]] == [("d1", False), ("d2", False)]
    assert moved == [("d1", ["d0", "d3"]), ("d2", ["d0", "d3"])]  # d2 was out already when d1's streams moved


def test_an_unknown_name_or_an_empty_list_drains_none():
    workers, moved = registry(), []
    with TestClient(app_with(workers, moved)) as c:
        unknown = c.post("/admin/workers/drain", json={"names": ["d0", "d9"]})
        empty = c.post("/admin/workers/drain", json={"names": []})
    assert unknown.status_code == 404 and "d9" in unknown.json()["error"]["message"]
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "names"
    assert moved == [] and all(w.in_rotation for w in workers.workers)
