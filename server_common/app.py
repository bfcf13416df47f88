"""Both servers' FastAPI app: the service starts and stops with it, behind the guard
(``server_common.guard``), with the routes both share (/abort, /health, /metrics, /kv/events,
/kv/events/stream, /kv/blocks, /debug/timeline, /debug/bookkeeping, /debug/tracemalloc[/start|/stop],
and /admin/faults when fault injection is on). Every route but /health and /metrics needs the internal
secret (the guard)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server_common.fault_routes import add_fault_routes
from server_common.guard import BodyCapMiddleware, install_guard
from server_common.heap_debug import HeapSnapshots
from server_common.kv_event_stream import MAX_STREAMS, Changes, event_stream
from server_common.memory import Trimmer, trim_while_busy
from server_common.stats_log import log_stats, server_line, server_snapshot
from server_common.strict_json import StrictJSONRoute
from transfer.outcome import Outcome
from wire.replies import ErrorReply, KvBlocksReply, KvEventsReply
from wire.requests import AbortRequest


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field; never the values (a NaN would not even serialise)."""
    fields = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", ""))} for e in exc.errors()]
    first = fields[0] if fields else {"loc": [], "msg": "invalid request"}
    return JSONResponse(
        {"error": f"{'.'.join(first['loc'])}: {first['msg']}", "code": "bad_request", "fields": fields[:20]},
        status_code=422,
    )


def service_app(service, title: str) -> FastAPI:
    """A server's FastAPI app: the service starts and stops with it, behind the guard,
    with the routes both servers share.

    ``service`` has async ``start()``/``stop()``/``abort(id)``, ``health()``, ``engine``,
    ``metrics``, ``faults``, ``settings``, ``drain``, ``kv_events`` (engine/kv_events.py), ``bookkeeping()``
    (entries per map that grows with traffic) and
    ``vitals`` (``server_common.vitals``:
    /health answers 503 while a thread is dead or stuck, and a dead one ends the process).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        tasks = [asyncio.ensure_future(service.vitals.watch())]

        def steps() -> tuple[int, ...]:  # changes while the engine works
            return tuple(service.engine_thread.stats.counters.steps.values())

        # Freed pages back to the system while the engine works (server_common/memory.py).
        tasks.append(asyncio.ensure_future(trim_while_busy(Trimmer(), steps)))
        interval = service.settings.log_stats_interval_s
        if interval > 0:
            name = service.settings.name
            tasks.append(
                asyncio.ensure_future(
                    log_stats(lambda: server_snapshot(service), lambda a, b: server_line(name, a, b), interval)
                )
            )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await service.stop()

    app = FastAPI(title=title, lifespan=lifespan)
    app.router.route_class = StrictJSONRoute  # NaN and Infinity are not JSON (server_common/strict_json.py)
    # Added before the guard, so it runs after it: a caller without the secret gets 401 before a byte
    # of its body is read, one with it no more than the cap.
    app.add_middleware(BodyCapMiddleware, max_bytes=service.settings.max_body_bytes)
    install_guard(app, service.settings.internal_secret, service.drain)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    _add_common_routes(app, service)
    return app


def _add_common_routes(app: FastAPI, service) -> None:
    """/abort, /health, /metrics, /kv/events, /kv/blocks (and /admin/faults when enabled): the same on
    both servers."""

    @app.post("/abort")
    async def abort(req: AbortRequest) -> JSONResponse:
        return JSONResponse({"request_id": req.request_id, "aborted": await service.abort(req.request_id)})

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = service.vitals.problem()  # a dead or stuck engine or transfer thread
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "error": problem}, status_code=503)
        return JSONResponse(service.health().model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/timeline")
    async def timeline() -> JSONResponse:
        """Stage timestamps of the last requests (server_common/timeline_log.py)."""
        return JSONResponse(
            {"instance": service.settings.name, "role": service.settings.role, "requests": service.timeline.entries()}
        )

    @app.get("/debug/bookkeeping")
    async def bookkeeping() -> JSONResponse:
        """Entries in each map that grows with traffic: per-request ones are 0 once idle, the others stay
        within their bounds (bench/load/soak.py samples this)."""
        return JSONResponse(
            {"instance": service.settings.name, "role": service.settings.role, "sizes": service.bookkeeping()}
        )

    _add_heap_routes(app)
    _add_kv_cache_routes(app, service)
    if service.faults is not None:  # config fault_injection: true (tests only)
        add_fault_routes(app, service.faults)


def _add_heap_routes(app: FastAPI) -> None:
    """Python allocations traced on demand (server_common/heap_debug.py): where memory grows."""
    heap = HeapSnapshots()

    @app.post("/debug/tracemalloc/start")
    async def heap_start(frames: int = 8) -> JSONResponse:
        """Trace Python allocations from now on (server_common/heap_debug.py); costly, off by default."""
        heap.start(max(1, min(frames, 64)))
        return JSONResponse({"tracing": True, "frames": max(1, min(frames, 64))})

    @app.post("/debug/tracemalloc/stop")
    async def heap_stop() -> JSONResponse:
        heap.stop()
        return JSONResponse({"tracing": False})

    @app.get("/debug/tracemalloc")
    async def heap_growth(top: int = 25, group_by: Literal["lineno", "traceback", "filename"] = "lineno"):
        """Where traced Python memory grew since the last call (server_common/heap_debug.py); 409 while
        tracing is off."""
        if not heap.tracing():
            reply = ErrorReply(
                error="tracemalloc is off: POST /debug/tracemalloc/start first", code=Outcome.BAD_REQUEST
            )
            return JSONResponse(reply.model_dump(mode="json"), status_code=409)
        return JSONResponse(await asyncio.to_thread(heap.growth, max(1, min(top, 500)), group_by))


def _add_kv_cache_routes(app: FastAPI, service) -> None:
    """The engine's cached block hashes, as events and as a snapshot, for the router's cache index."""

    @app.get("/kv/events")
    async def kv_events(after: int = 0) -> JSONResponse:
        """Block hashes stored and evicted after seq ``after`` (for the router's cache index)."""
        page, engine = service.kv_events.since(after), service.settings.engine
        return JSONResponse(
            KvEventsReply(
                epoch=page.epoch,
                oldest=page.oldest,
                last=page.last,
                events=page.events,
                block_size=engine.block_size,
                salt=engine.cache_salt,
                enabled=engine.prefix_caching,
            ).model_dump(mode="json")
        )

    @app.get("/kv/events/stream")
    async def kv_event_stream(request: Request, after: int = 0) -> Response:
        """The events after seq ``after``, then each new batch as it happens, as NDJSON lines
        (server_common/kv_event_stream.py): the router's cache index follows a server through it."""
        state = request.app.state
        if service.drain.draining:
            return JSONResponse(
                ErrorReply(error="the server is draining", code=Outcome.DRAINING).model_dump(),
                status_code=503,
                headers={"Retry-After": "1"},
            )
        if getattr(state, "kv_changes", None) is None:
            state.kv_changes = Changes(service.kv_events, asyncio.get_running_loop())
        if state.kv_changes.streams >= MAX_STREAMS:
            return JSONResponse(
                ErrorReply(error=f"{MAX_STREAMS} event streams are open", code=Outcome.NO_ROOM).model_dump(),
                status_code=503,
                headers={"Retry-After": "1"},
            )
        engine = service.settings.engine
        stream = event_stream(
            service.kv_events,
            state.kv_changes,
            after,
            block_size=engine.block_size,
            salt=engine.cache_salt,
            enabled=engine.prefix_caching,
            ended=lambda: service.drain.draining,
        )
        return StreamingResponse(stream, media_type="application/x-ndjson")

    @app.get("/kv/blocks")
    async def kv_blocks() -> JSONResponse:
        """Every block hash held now: what a reader that lost events starts again from."""
        snap, engine = service.kv_events.snapshot(), service.settings.engine
        return JSONResponse(
            KvBlocksReply(
                epoch=snap.epoch,
                seq=snap.seq,
                hashes=snap.hashes,
                tiered=snap.tiered,
                block_size=engine.block_size,
                salt=engine.cache_salt,
                enabled=engine.prefix_caching,
            ).model_dump(mode="json")
        )
