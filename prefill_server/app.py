"""The prefill server's HTTP control plane: thin routes over ``PrefillService``."""

from __future__ import annotations


from fastapi import FastAPI
from fastapi.responses import JSONResponse

from prefill_server.service import PrefillService
from server_common.guard import service_app
from server_common.worker_replies import WorkerError
from server_common.worker_requests import PrefillRequest


def create_app(service: PrefillService) -> FastAPI:
    app = service_app(service, f"pdserve prefill server {service.settings.name}")

    @app.post("/prefill")
    async def prefill(req: PrefillRequest) -> JSONResponse:
        """Answers once the KV is in the decode server's blocks and the notice is sent."""
        try:
            result = await service.prefill(req)
        except WorkerError as exc:
            return JSONResponse(exc.reply().model_dump(mode="json"), status_code=exc.status)
        return JSONResponse(result.model_dump())
    return app
