"""The router's FastAPI app: thin routes over ``OpenAIHandlers``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from router.access_log import AccessLog
from router.admin import add_admin_routes
from router.api import api_responses as out
from router.api import openapi
from router.api.api_requests import ChatCompletionRequest, CompletionRequest
from router.api.grammar_check import GrammarChecker
from router.api.limits import RequestLimits, openai_413
from router.api.model import ServedModel
from router.api.openai_handlers import Answered, OpenAIHandlers
from router.cluster.admission import Admission, AdmissionSettings
from router.cluster.discovery import Discovery
from router.cluster.dispatch import Dispatcher, DispatchSettings
from router.cluster.health import PassiveHealth
from router.cluster.http_pool import worker_http
from router.cluster.kv_events import KvEventPoller
from router.cluster.kv_index import KvIndex
from router.cluster.policies import make_policy
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.worker_client import WorkerClient
from router.errors import OpenAIError, RequestIdMiddleware, install_error_handlers, request_id_of
from router.metrics import RouterMetrics
from router.settings import RouterSettings
from server_common.connections import ConnectionGuard
from server_common.guard import BodyCapMiddleware, Drain, auth_headers, bearer_token, token_matches
from server_common.memory import TrimAfterLargeRequests, Trimmer
from server_common.model_id import model_fingerprint
from server_common.process_defaults import is_loopback
from server_common.stats_log import RouterSnapshot, log_stats, router_line
from server_common.strict_json import StrictJSONRoute
from server_common.tracing import Tracing

DISCONNECT_POLL_S = 0.25
HEALTH_CONNECTIONS = 64  # the health checks' own client: at most this many checks at once, each on its own connection
T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (its ``finally`` aborts the request on the servers)
    if the client goes away first. Streams notice a disconnect by themselves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise OpenAIError(499, "client closed the request")
    finally:
        if not task.done():
            task.cancel()


def create_app(settings: RouterSettings, model: ServedModel | None = None,
               client: WorkerClient | None = None) -> FastAPI:
    """``model`` and ``client`` (a WorkerClient look-alike) may be given by unit tests.

    ``app.state.drain`` is what SIGTERM starts (``server_common.run.serve``):
    new requests then get 503, requests in flight or waiting for a slot finish.
    """
    model = model or ServedModel.load(settings.served_model_name, settings.model_path, settings.max_model_len)
    # The config's workers are out of rotation until their first health check passes (at once, when the
    # registry runs): the router's /health says ready only once a request would find a decode server.
    registry = WorkerRegistry([Worker(w.name, w.role, w.url, max_inflight=w.max_inflight, healthy=False)
                               for w in settings.workers],
                              health_interval_s=settings.health_interval_s, health_timeout_s=settings.health_timeout_s,
                              health_backoff_max_s=settings.health_backoff_max_s,
                              launch_id=settings.workers_launch_id, stream_stall_s=settings.stream_stall_s)
    metrics = RouterMetrics(registry)
    admission = Admission(AdmissionSettings(max_queued_requests=settings.max_queued_requests,
                                            queue_timeout_s=settings.queue_timeout_s,
                                            retry_after_s=settings.retry_after_s), on_wait=metrics.queue_time.observe)
    metrics.watch_admission(admission)
    # Slow and greedy clients (server_common.connections): `pdserve router` serves with its protocol class.
    connections = ConnectionGuard(settings.header_timeout_s, settings.body_timeout_s,
                                  settings.max_connections_per_client,
                                  max_connections=settings.max_connections, reserved=settings.reserved_connections)
    metrics.registry.register(connections)
    dispatch_settings = DispatchSettings(local_prefill_threshold=settings.local_prefill_threshold,
                                         prefill_failure=settings.prefill_failure,
                                         max_request_kv_share=settings.max_request_kv_share)
    limits = RequestLimits(max_prompt_tokens=settings.max_prompt_tokens, max_tokens=settings.max_tokens)
    tracing = Tracing(settings.tracing, "pdserve-router")
    passive_health = PassiveHealth(registry)
    # Which block hashes each server holds (router/cluster/kv_index.py), kept only when something reads it:
    # the cache_aware policy, and the local-prefill choice on the uncached length (router/cluster/dispatch.py).
    kv_index = KvIndex() if settings.policy == "cache_aware" or settings.local_prefill_threshold > 0 else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Requests and health checks on separate clients: a check never waits behind requests for a connection.
        headers = auth_headers(settings.internal_secret)
        keepalive_s = settings.worker_keepalive_s
        n = HEALTH_CONNECTIONS  # workers may join at runtime: not sized by today's count
        async with worker_http(settings.worker_connections, settings.worker_keepalive, keepalive_s, headers) as http, \
                worker_http(n, n, keepalive_s, headers) as health_http:
            worker_client = client or WorkerClient(http, prefill_timeout_s=settings.prefill_timeout_s,
                                                   answered=passive_health.answered,
                                                   stream_stall_s=settings.stream_stall_s)
            dispatcher = Dispatcher(registry, make_policy(settings.policy, kv_index, settings.cache_aware_load_weight),
                                    make_policy(settings.policy, kv_index, settings.cache_aware_load_weight),
                                    worker_client, dispatch_settings, metrics.recovery, admission, drain,
                                    passive_health, kv_index)
            grammars = GrammarChecker(settings.grammar_sandbox)
            await asyncio.to_thread(grammars.start)
            app.state.handlers = OpenAIHandlers(model, dispatcher, metrics, limits, tracing, grammars,
                                                settings.grammar_limits, access)
            app.state.discovery = Discovery(registry, http, settings.discovery, model_fingerprint(settings.model_path),
                                            metrics, settings.drain_timeout_s)
            tasks = [asyncio.create_task(registry.run(health_http)),
                     asyncio.create_task(app.state.discovery.run())] if client is None else []
            if kv_index is not None and client is None:
                poller = KvEventPoller(registry, kv_index, health_http, settings.kv_events_interval_s)
                tasks.append(asyncio.create_task(poller.run()))
            if settings.log_stats_interval_s > 0:
                stats = log_stats(router_snapshot,
                                  router_line,  # type: ignore[arg-type]  # log_stats types its snapshots as object
                                  settings.log_stats_interval_s)
                tasks.append(asyncio.create_task(stats))
            app.state.kv_index = kv_index
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                app.state.handlers.shutdown()
                tracing.shutdown()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.router.route_class = StrictJSONRoute  # NaN and Infinity are not JSON (server_common/strict_json.py)
    openapi.install(app, vocab_size=model.vocab_size, api_keys=bool(settings.api_keys),
                    max_new_tokens=min(settings.max_tokens or model.max_model_len - 1, model.max_model_len - 1))

    # What a drain waits for: requests with a session or waiting for one.
    app.state.drain = drain = Drain(lambda: admission.sessions + admission.waiting)
    app.state.connections = connections
    app.state.registry = registry
    app.add_middleware(BodyCapMiddleware, max_bytes=settings.max_body_bytes, refusal_body=openai_413)
    app.state.trimmer = Trimmer()
    app.add_middleware(TrimAfterLargeRequests, trimmer=app.state.trimmer)  # their memory back to the system
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, a 413 too, has an id
    install_error_handlers(app)

    def check_auth(request: Request) -> None:
        if not settings.api_keys:
            return
        if not token_matches(bearer_token(request.headers.get("authorization", "")), settings.api_keys):
            raise OpenAIError(401, "missing or invalid API key", code="invalid_api_key")

    def check_admin(request: Request) -> None:
        """The internal secret when there is one, else an API key; with neither, callers on this machine only."""
        if settings.internal_secret:
            if not token_matches(bearer_token(request.headers.get("authorization", "")), [settings.internal_secret]):
                raise OpenAIError(401, "admin calls need the cluster's internal secret", code="invalid_api_key")
        elif settings.api_keys:
            check_auth(request)
        elif request.client is None or not is_loopback(request.client.host):
            raise OpenAIError(403, "admin calls from other machines need security.internal_secret in the config",
                              code="forbidden")

    add_admin_routes(app, registry, check_admin, lambda: app.state.discovery)
    access = AccessLog(settings.access_log)  # one line per request (router/access_log.py)

    def router_snapshot() -> RouterSnapshot:
        value = metrics.registry.get_sample_value
        requests = sum(s.value for m in metrics.requests.collect() for s in m.samples if s.name.endswith("_total"))
        return RouterSnapshot(time.monotonic(), int(requests), admission.sessions, admission.waiting,
                              int(value("pdserve_router_prompt_tokens_total") or 0),
                              int(value("pdserve_router_completion_tokens_total") or 0),
                              sum(w.in_rotation for w in registry.workers), len(registry.workers))

    async def respond(request: Request, endpoint: str,
                      call: Callable[[str, str | None, int], Awaitable[Answered]]) -> Response:
        """``call(request_id, traceparent, body_bytes)``: the handler's coroutine for this request."""
        rid = request_id_of(request)
        try:
            check_auth(request)
        except OpenAIError as exc:
            access.refused(rid, endpoint, exc.status, exc.code)
            raise
        metrics.inflight.inc()
        status, code = 500, None
        try:
            answer = await until_disconnect(request, call(rid, request.headers.get("traceparent"),
                                                          len(await request.body())))
            status = 200
        except OpenAIError as exc:
            status, code = exc.status, exc.code
            raise
        finally:
            metrics.inflight.dec()
            metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            if status != 200:
                access.refused(rid, endpoint, status, code)
        if answer[0] is None:
            return answer[1]  # encoded by the handler (off the event loop when large)
        session, result = answer
        # session.close is idempotent: the stream closes it in `finally`, the
        # background task covers a client that left before the first chunk.
        return StreamingResponse(result, media_type="text/event-stream", background=BackgroundTask(session.close),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions", responses=openapi.generation_responses(out.ChatCompletion,
                                                                             "ChatCompletionChunk"))
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await respond(request, "chat", lambda *args: request.app.state.handlers.chat(req, *args))

    @app.post("/v1/completions", responses=openapi.generation_responses(out.Completion, "Completion"))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await respond(request, "completions", lambda *args: request.app.state.handlers.completion(req, *args))

    @app.get("/v1/models", responses=openapi.ok(out.ModelList, "The served model.") | openapi.errors(401, 500))
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        return JSONResponse(request.app.state.handlers.models().model_dump())

    @app.get("/v1/models/{model:path}", responses=openapi.ok(out.ModelCard, "The served model's card.")
             | openapi.errors(401, 404, 500))
    async def model_card(model: str, request: Request) -> JSONResponse:
        """The SDK's ``client.models.retrieve(id)``; ids may contain '/' (``org/name``)."""
        check_auth(request)
        return JSONResponse(request.app.state.handlers.model_card(model).model_dump())

    @app.get("/health", responses=openapi.HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        workers = [openapi.WorkerHealth(name=w.name, role=w.role, url=w.url, healthy=w.healthy,
                                        in_rotation=w.in_rotation) for w in registry.workers]
        ok = bool(registry.healthy("decode")) and not drain.draining
        status: openapi.HealthStatus = "draining" if drain.draining else "ok" if ok else "degraded"
        body = openapi.Health(status=status, workers=workers, launch_id=settings.launch_id)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    # Admin and debug routes stay out of the published document (router/api/openapi.py says why).
    @app.get("/debug/timeline", include_in_schema=False)
    async def timeline(request: Request) -> JSONResponse:
        """Stage timestamps of the last requests (server_common/timeline_log.py); admin callers only."""
        check_admin(request)
        return JSONResponse({"instance": "router", "role": "router",
                             "requests": request.app.state.handlers.timeline.entries()})

    @app.get("/debug/kv_index", include_in_schema=False)
    async def kv_index_state(request: Request) -> JSONResponse:
        """What the router knows of each server's cached blocks (router/cluster/kv_index.py); admin callers only."""
        check_admin(request)
        workers = {} if kv_index is None else {
            name: {"epoch": idx.epoch, "seq": idx.seq, "blocks": len(idx.hashes), "block_size": idx.block_size,
                   "resyncs": idx.resyncs} for name, idx in kv_index.workers.items()}
        return JSONResponse({"enabled": kv_index is not None, "workers": workers})

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS_RESPONSES)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
