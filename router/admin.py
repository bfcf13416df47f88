"""The router's admin endpoints: workers in and out of rotation, joining and leaving.

    GET    /admin/workers                  every worker: health, draining, requests in flight, limit
    POST   /admin/workers {"url": U}       the worker at U joins (router/cluster/discovery.py: asked for its role,
                                           name and model; 409 when refused, naming why)
    DELETE /admin/workers/{name}           it leaves: drained (its requests finish, or move), then forgotten
    POST   /admin/workers/{name}/drain     no new request goes to it; its requests in flight finish, or move
                                           (?wait_s=N: answer once they did, or after N seconds)

With ``drain: migrate`` (the default) the requests a decode server streams
move to other decode servers at once (``Dispatcher.move_off``: migration,
router/cluster/session.py), so it is empty within about a prefill of their
tokens, not after the longest of them; with ``wait`` they finish where they are.
    POST   /admin/workers/drain {"names": [N, ...]}
                                           several at once: every one out of rotation before any
                                           one's streams move, so none moves onto another of them
                                           (the planner's donors of several switches,
                                           deploy/planner_loop.py); 404 naming an unknown one,
                                           before any is drained
    POST   /admin/workers/{name}/resume    back in rotation
    POST   /admin/workers/{name}/role {"role": R}
                                           switch it in place to R (prefill, decode or colocated): out of
                                           rotation, its requests finish or move, the worker's own
                                           POST /admin/role drains it, keeps its engine and bumps its role
                                           epoch (deploy/role_server.py), then it is discovered again in its
                                           new role (router/cluster/discovery.py). Answers its description
                                           with "role_epoch" and "seconds". 404: no such worker; 400: an
                                           unknown role; 409: another switch is in flight
                                           (switch_in_progress), or it is the last prefill or decode
                                           server in rotation (no_prefill_left, no_decode_left); the
                                           worker's own refusal (409) or failure (502) with its code.

A worker can also drain itself (its own ``POST /admin/drain``, or SIGTERM);
the router then sees ``draining`` in its health report. Admin calls need the
cluster's internal secret as a Bearer token when one is configured (else an
API key, when those are configured). They are left out of the published
OpenAPI document (router/api/openapi.py says why).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from router.cluster.discovery import Discovery, JoinRefused, SwitchRefused
from router.cluster.registry import Worker, WorkerRegistry
from router.errors import OpenAIError


class RoleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = Field(max_length=32)  # checked by Discovery.switch_role (400 names the roles)


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1, max_length=256)


class JoinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=8, max_length=300, pattern=r"^https?://[^/\s]+/?$")


WAIT_POLL_S = 0.05


def describe(w: Worker) -> dict:
    return {
        "name": w.name,
        "role": w.role,
        "url": w.url,
        "healthy": w.healthy,
        "in_rotation": w.in_rotation,
        "draining": w.draining,
        "reported_draining": w.reported_draining,
        "inflight": w.inflight,
        "max_inflight": w.max_inflight,
        "role_epoch": w.role_epoch,
    }


def add_admin_routes(
    app: FastAPI,
    registry: WorkerRegistry,
    authorize: Callable[[Request], None],
    discovery: Callable[[], Discovery],
    move_off: Callable[[str], int] | None = None,
) -> None:
    """``move_off(name)``: migrate the requests a leaving decode server streams (None: they finish there)."""

    def drain_out(w: Worker) -> None:
        w.set_draining(True)  # out of rotation first: nothing migrates back onto it
        if move_off is not None:
            move_off(w.name)

    def worker(name: str) -> Worker:
        found = registry.find(name)
        if found is None:
            raise OpenAIError(
                404, f"no worker named {name!r} (have {[w.name for w in registry.workers]})", param="name"
            )
        return found

    @app.get("/admin/workers", include_in_schema=False)
    async def workers(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"workers": [describe(w) for w in registry.workers]})

    @app.post("/admin/workers", include_in_schema=False)
    async def join(body: JoinRequest, request: Request) -> JSONResponse:
        authorize(request)
        try:
            worker = await discovery().join(body.url)
        except JoinRefused as exc:
            raise OpenAIError(409, str(exc), param="url", code=exc.reason) from None
        return JSONResponse(describe(worker))

    @app.delete("/admin/workers/{name}", include_in_schema=False)
    async def leave(name: str, request: Request) -> JSONResponse:
        authorize(request)
        drain_out(worker(name))
        left = await discovery().leave(name)
        if left is None:  # another call made it leave meanwhile
            raise OpenAIError(404, f"no worker named {name!r}", param="name")
        return JSONResponse(describe(left) | {"left": True})

    @app.post("/admin/workers/drain", include_in_schema=False)
    async def drain_several(body: DrainRequest, request: Request) -> JSONResponse:
        authorize(request)
        chosen = list({w.name: w for w in map(worker, body.names)}.values())  # each known, before any drains
        for w in chosen:
            w.set_draining(True)
        if move_off is not None:
            for w in chosen:
                move_off(w.name)
        return JSONResponse({"workers": [describe(w) for w in chosen]})

    @app.post("/admin/workers/{name}/drain", include_in_schema=False)
    async def drain(name: str, request: Request, wait_s: float = Query(0.0, ge=0, le=600)) -> JSONResponse:
        authorize(request)
        w = worker(name)
        drain_out(w)
        await registry.drain(w, wait_s, WAIT_POLL_S)
        return JSONResponse(describe(w))

    @app.post("/admin/workers/{name}/resume", include_in_schema=False)
    async def resume(name: str, request: Request) -> JSONResponse:
        authorize(request)
        w = worker(name)
        w.set_draining(False)
        return JSONResponse(describe(w))

    @app.post("/admin/workers/{name}/role", include_in_schema=False)
    async def switch_role(name: str, body: RoleRequest, request: Request) -> JSONResponse:
        authorize(request)
        try:
            done = await discovery().switch_role(name, body.role, move_off)
        except SwitchRefused as exc:
            param = {400: "role", 404: "name"}.get(exc.status)
            raise OpenAIError(exc.status, str(exc), param=param, code=exc.reason) from None
        figures = {"seconds": round(done["seconds"], 4), "server_seconds": done["server_seconds"]}
        return JSONResponse(describe(done["worker"]) | figures)
