"""The prefill server's HTTP control plane: thin routes over ``PrefillService``."""

from __future__ import annotations


from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefill_server.service import PrefillFailed, PrefillService
from server_common.fault_routes import add_fault_routes
from server_common.guard import service_app
from server_common.worker_replies import RefusedReply
from server_common.worker_requests import AbortRequest, PrefillRequest


def create_app(service: PrefillService) -> FastAPI:
    app = service_app(service, f"pdserve prefill server {service.settings.name}")

    @app.post("/prefill")
    async def prefill(req: PrefillRequest) -> JSONResponse:
        """Answers once the KV is in the decode server's blocks and the notice is sent."""
        try:
            result = await service.prefill(req)
        except PrefillFailed as exc:
            return JSONResponse(RefusedReply(error=exc.message, code=exc.code).model_dump(), status_code=exc.status)
        return JSONResponse(result.model_dump())

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
