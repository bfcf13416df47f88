"""The decode server's HTTP control plane: thin routes over ``DecodeService``."""

from __future__ import annotations

import base64

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from decode_server.service import DecodeService, Refused
from server_common.fault_routes import add_fault_routes
from server_common.guard import service_app
from server_common.worker_replies import RefusedReply
from server_common.worker_requests import AbortRequest, GenerateRequest, KVHello


def create_app(service: DecodeService) -> FastAPI:
    app = service_app(service, f"pdserve {service.settings.role} server {service.settings.name}")

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> Response:
        """NDJSON stream: reservation first, then tokens (see server_common.worker_replies)."""
        try:
            first, active = await service.open(req)
        except Refused as exc:
            headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after else {}
            body = RefusedReply(error=exc.message, code=exc.code).model_dump()
            return JSONResponse(body, status_code=exc.status, headers=headers)
        # close() is idempotent: the stream closes in `finally`, the background
        # task covers a client that left before the first line was sent.
        return StreamingResponse(service.events(first, active), media_type="application/x-ndjson",
                                 background=BackgroundTask(service.close, req.request_id))

    @app.post("/kv/hello")
    async def kv_hello(req: KVHello) -> JSONResponse:
        """Transfer handshake from a prefill server: its hello in, ours back (base64 msgpack)."""
        try:
            answer = await service.accept_sender(base64.b64decode(req.hello, validate=True))
        except (ValueError, TimeoutError, RuntimeError) as exc:
            return JSONResponse(RefusedReply(error=str(exc), code="incompatible_peer").model_dump(), status_code=400)
        return JSONResponse(KVHello(hello=base64.b64encode(answer).decode()).model_dump())

    @app.post("/abort")
    async def abort(req: AbortRequest) -> JSONResponse:
        return JSONResponse({"request_id": req.request_id, "aborted": await service.abort(req.request_id)})

    @app.get("/health")
    async def health() -> JSONResponse:
        if not service.engine.alive:
            return JSONResponse({"status": "engine_down", "error": repr(service.engine.error)}, status_code=503)
        return JSONResponse(service.health().model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if service.faults is not None:  # config fault_injection: true (tests only)
        add_fault_routes(app, service.faults)
    return app
