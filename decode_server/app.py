"""The decode server's HTTP control plane: thin routes over ``GenerationService``."""

from __future__ import annotations

import base64

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from decode_server.service import GenerationService
from kvlink.prefix_read import CONTENT_TYPE
from server_common.app import service_app
from transfer.outcome import Outcome
from wire.replies import ErrorReply, WorkerError
from wire.requests import GenerateRequest, KVHello, KVPrefixRead


def create_app(service: GenerationService) -> FastAPI:
    app = service_app(service, f"pdserve {service.settings.role} server {service.settings.name}")

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Response:
        """NDJSON stream: reservation first, then tokens (see wire.replies)."""
        try:
            first, active = await service.open(req, request.client.host if request.client else "")
        except WorkerError as exc:
            headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after else {}
            return JSONResponse(exc.reply().model_dump(mode="json"), status_code=exc.status, headers=headers)
        # close() is idempotent: the stream closes in `finally`, the background
        # task covers a client that left before the first line was sent.
        return StreamingResponse(
            service.events(first, active),
            media_type="application/x-ndjson",
            background=BackgroundTask(service.close, req.request_id),
        )

    @app.post("/kv/hello")
    async def kv_hello(req: KVHello) -> JSONResponse:
        """Transfer handshake from a prefill server: its hello in, ours back (base64 msgpack)."""
        try:
            answers = await service.accept_sender(base64.b64decode(req.hello, validate=True))
        except WorkerError as exc:
            return JSONResponse(exc.reply().model_dump(mode="json"), status_code=exc.status)
        except (ValueError, TimeoutError, RuntimeError) as exc:
            reply = ErrorReply(error=str(exc), code=Outcome.INCOMPATIBLE_PEER)
            return JSONResponse(reply.model_dump(mode="json"), status_code=400)
        first, *ranks = [base64.b64encode(a).decode() for a in answers]
        return JSONResponse(KVHello(hello=first, ranks=ranks).model_dump())

    @app.post("/kv/read")
    async def kv_read(req: KVPrefixRead) -> Response:
        """A prefill server reads a reservation's cached prefix (decode-to-prefill reuse): the tokens' K/V
        as the body, what they are in headers (kvlink/prefix_read.py), while the reservation waits for its
        KV; 409 after."""
        try:
            headers, body = await service.read_prefix(req)
        except WorkerError as exc:
            return JSONResponse(exc.reply().model_dump(mode="json"), status_code=exc.status)
        return Response(body, media_type=CONTENT_TYPE, headers=headers)

    return app
