"""The prefill server's HTTP control plane: thin routes over ``PrefillService``."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from prefill_server.service import PrefillService
from server_common.app import service_app
from wire.replies import WorkerError
from wire.requests import DecodePeer, PrefillRequest


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

    @app.get("/admin/peers")
    async def peers() -> JSONResponse:
        """The decode servers this prefill server may hand KV to (the config's and those announced)."""
        return JSONResponse({"peers": service.peers()})

    @app.post("/admin/peers")
    async def add_peer(peer: DecodePeer) -> JSONResponse:
        """A decode server joined (the router's discovery): KV may now go to it. One the
        config lists is never re-pointed (409)."""
        try:
            service.add_peer(peer.name, peer.url)
        except WorkerError as exc:
            return JSONResponse(exc.reply().model_dump(mode="json"), status_code=exc.status)
        return JSONResponse({"peers": service.peers()})

    @app.delete("/admin/peers/{name}")
    async def forget_peer(name: str) -> JSONResponse:
        """A decode server left: its transfers end and what the transfer layer held for it is released."""
        return JSONResponse({"forgotten": service.forget_peer(name), "peers": service.peers()})

    return app
