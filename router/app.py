"""The router's FastAPI app.

``RouterParts`` is what a router is made of (workers, admission, metrics, the drain, auth), built
from its settings; ``lifespan`` starts the connections to the workers and the background tasks
with the app; the routes are added in three groups: the OpenAI API, admin (router/admin.py), and
the operator's (health, metrics, debug views)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from router.access_log import AccessLog
from router.admin import add_admin_routes
from router.api import api_responses as out
from router.api import openapi
from router.api.api_requests import ChatCompletionRequest, CompletionRequest
from router.api.background import EventLimits
from router.api.event_stream import EventStream
from router.api.grammar_check import GrammarChecker
from router.api.limits import RequestLimits, openai_413
from router.api.model import ServedModel
from router.api.openai_handlers import Answered, OpenAIHandlers
from router.api.response_store import ResponseStore, open_store, owner_of
from router.api.responses import ResponsesHandler, ResponsesRequest
from router.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize_answer, tokenize_answer
from router.cluster import tenancy
from router.cluster.admission import Admission, AdmissionSettings
from router.cluster.discovery import Discovery
from router.cluster.dispatch import Dispatcher, DispatchSettings
from router.cluster.h1_client import H1Client
from router.cluster.health import PassiveHealth
from router.cluster.http_pool import worker_http
from router.cluster.kv_events import KvEventPoller, KvEventStreams
from router.cluster.kv_index import KvIndex
from router.cluster.policies import make_policy
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.tenancy import PRIORITY_HEADER, Tenancy
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


class _DisconnectWatch:
    """Every ``DISCONNECT_POLL_S`` while armed, whether the client of ``request`` went away; if it did,
    ``task`` is cancelled. Costs one timer while nothing is due (a request's work is mostly shorter)."""

    def __init__(self, request: Request, task: asyncio.Task) -> None:
        self.request, self.task = request, task
        self.cancelled = False  # whether this watch cancelled the task
        self._check: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, self._due)

    def _due(self) -> None:
        self._check = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        gone = await self.request.is_disconnected()
        if self._timer is None:  # disarmed meanwhile: the work is over
            return
        if gone:
            self.cancelled = True
            self.task.cancel()
        else:
            self._timer = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, self._due)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._check is not None and not self._check.done():
            self._check.cancel()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (its ``finally`` aborts the request on the servers), and answer 499, if
    the client goes away first. Streams notice a disconnect by themselves.

    ``work`` runs in the request's own task (no task of its own per request); the watch cancels that
    task only while it waits in ``work``, since it is disarmed before anything else is awaited."""
    task = asyncio.current_task()
    assert task is not None  # ASGI apps run in a task
    watch = _DisconnectWatch(request, task)
    try:
        result = await work
    except BaseException:
        if not watch.cancelled:
            raise
    else:
        if not watch.cancelled:  # finished before (or despite) the cancellation
            return result
    finally:
        watch.disarm()
    task.uncancel()  # the watch's own cancellation, for the client that left
    raise OpenAIError(499, "client closed the request")


class Auth:
    """Who may call what: clients need an API key when the config lists some; admin and debug
    routes need the internal secret when there is one, else an API key, else a caller on this machine."""

    def __init__(self, api_keys: tuple[str, ...], internal_secret: str | None) -> None:
        self.api_keys, self.internal_secret = api_keys, internal_secret

    def client(self, request: Request) -> None:
        if self.api_keys and not token_matches(bearer_token(request.headers.get("authorization", "")), self.api_keys):
            raise OpenAIError(401, "missing or invalid API key", code="invalid_api_key")

    def key(self, request: Request) -> str | None:
        """The caller's API key (None without keys)."""
        return bearer_token(request.headers.get("authorization", "")) if self.api_keys else None

    def owner(self, request: Request) -> str:
        """Whose stored responses a caller sees: its API key's (everyone's the same without keys)."""
        return owner_of(self.key(request))

    def admin(self, request: Request) -> None:
        if self.internal_secret:
            if not token_matches(bearer_token(request.headers.get("authorization", "")), [self.internal_secret]):
                raise OpenAIError(401, "admin calls need the cluster's internal secret", code="invalid_api_key")
        elif self.api_keys:
            self.client(request)
        elif request.client is None or not is_loopback(request.client.host):
            raise OpenAIError(
                403, "admin calls from other machines need security.internal_secret in the config", code="forbidden"
            )


@dataclass
class RouterParts:
    """What one router is made of, built before its app: the parts that live as long as the process.
    The HTTP clients, the dispatcher and the handlers that use them are made when the app starts
    (``lifespan``), since they need the running event loop."""

    settings: RouterSettings
    model: ServedModel
    registry: WorkerRegistry
    metrics: RouterMetrics
    admission: Admission
    drain: Drain
    connections: ConnectionGuard
    passive_health: PassiveHealth
    kv_index: KvIndex | None
    tracing: Tracing
    access: AccessLog
    auth: Auth
    tenancy: Tenancy  # each key's tenant: priority class, fair share, rate limits (router/cluster/tenancy.py)
    responses: ResponseStore  # stored /v1/responses (router/api/response_store/): SQLite or PostgreSQL

    @classmethod
    def build(cls, settings: RouterSettings, model: ServedModel) -> RouterParts:
        # The config's workers are out of rotation until their first health check passes (at once, when the
        # registry runs): the router's /health says ready only once a request would find a decode server.
        registry = WorkerRegistry(
            [Worker(w.name, w.role, w.url, max_inflight=w.max_inflight, healthy=False) for w in settings.workers],
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
            health_backoff_max_s=settings.health_backoff_max_s,
            launch_id=settings.workers_launch_id,
            stream_stall_s=settings.stream_stall_s,
        )
        metrics = RouterMetrics(registry)
        admission = Admission(
            AdmissionSettings(
                max_queued_requests=settings.max_queued_requests,
                queue_timeout_s=settings.queue_timeout_s,
                share_window_s=settings.tenant_share_window_s,
                retry_after_s=settings.retry_after_s,
            ),
            on_wait=metrics.queue_time.observe,
        )
        tenants = Tenancy(settings.tenants, settings.priority_classes, settings.limit_share)
        metrics.watch_admission(admission, tenants.tenants)
        # Slow and greedy clients (server_common.connections): `pdserve router` serves with its protocol class.
        connections = ConnectionGuard(
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.max_connections_per_client,
            max_connections=settings.max_connections,
            reserved=settings.reserved_connections,
        )
        metrics.registry.register(connections)
        # Which block hashes each server holds (router/cluster/kv_index.py), kept only when something reads it:
        # the cache_aware policy, and the local-prefill choice on the uncached length (router/cluster/dispatch.py).
        uses_index = settings.policy == "cache_aware" or settings.local_prefill_threshold > 0
        return cls(
            settings=settings,
            model=model,
            registry=registry,
            metrics=metrics,
            admission=admission,
            # What a drain (SIGTERM) waits for: requests with a session or waiting for one.
            drain=Drain(lambda: admission.sessions + admission.waiting),
            connections=connections,
            passive_health=PassiveHealth(registry),
            kv_index=KvIndex() if uses_index else None,
            tracing=Tracing(settings.tracing, "pdserve-router"),
            access=AccessLog(settings.access_log),  # one line per request (router/access_log.py)
            auth=Auth(settings.api_keys, settings.internal_secret),
            tenancy=tenants,
            responses=open_store(settings.response_store),
        )

    def snapshot(self) -> RouterSnapshot:
        """The numbers of the router's periodic stats line (server_common/stats_log.py)."""
        value = self.metrics.registry.get_sample_value
        requests = sum(s.value for m in self.metrics.requests.collect() for s in m.samples if s.name.endswith("_total"))
        return RouterSnapshot(
            time.monotonic(),
            int(requests),
            self.admission.sessions,
            self.admission.waiting,
            int(value("pdserve_router_prompt_tokens_total") or 0),
            int(value("pdserve_router_completion_tokens_total") or 0),
            sum(w.in_rotation for w in self.registry.workers),
            len(self.registry.workers),
        )


def lifespan(parts: RouterParts, client: WorkerClient | None) -> Callable[[FastAPI], AbstractAsyncContextManager]:
    """Start the router's connections and background tasks with the app, and stop them with it.
    ``client`` (a WorkerClient look-alike from a unit test) replaces the workers and every background task."""
    settings = parts.settings

    @contextlib.asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        # Requests and health checks on separate clients: a check never waits behind requests for a connection.
        headers = auth_headers(settings.internal_secret)
        keepalive_s = settings.worker_keepalive_s
        n = HEALTH_CONNECTIONS  # workers may join at runtime: not sized by today's count
        async with (
            # The requests' own client (router/cluster/h1_client.py); discovery's calls go on httpx.
            H1Client(settings.worker_connections, settings.worker_keepalive, keepalive_s, headers) as requests_http,
            worker_http(settings.worker_connections, settings.worker_keepalive, keepalive_s, headers) as http,
            worker_http(n, n, keepalive_s, headers) as health_http,
            # One event stream held open per worker (router.kv_events: push): a pool of their own.
            worker_http(settings.worker_connections, 0, keepalive_s, headers) as events_http,
        ):
            await _build_handlers(app, parts, client, requests_http, http)
            tasks = _background_tasks(app, parts, client, health_http, events_http)
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await app.state.responses.shutdown()  # background responses end, their rows written
                app.state.handlers.shutdown()
                parts.tracing.shutdown()
                parts.responses.close()

    return run


async def _build_handlers(
    app: FastAPI, parts: RouterParts, client: WorkerClient | None, requests_http: H1Client, http: httpx.AsyncClient
) -> None:
    """What the routes call (``app.state.handlers``, ``responses``, ``discovery``), over one
    dispatcher and the workers' request connections (``http``: discovery's)."""
    settings = parts.settings
    worker_client = client or WorkerClient(
        requests_http,
        prefill_timeout_s=settings.prefill_timeout_s,
        answered=parts.passive_health.answered,
        stream_stall_s=settings.stream_stall_s,
    )
    policy = settings.policy, parts.kv_index, settings.cache_aware_load_weight
    dispatcher = Dispatcher(
        parts.registry,
        make_policy(*policy),
        make_policy(*policy),
        worker_client,
        DispatchSettings(
            local_prefill_threshold=settings.local_prefill_threshold,
            prefill_failure=settings.prefill_failure,
            migration_limit=settings.migration_limit,
            max_request_kv_share=settings.max_request_kv_share,
        ),
        parts.metrics.recovery,
        parts.admission,
        parts.drain,
        parts.passive_health,
        parts.kv_index,
    )
    grammars = GrammarChecker(settings.grammar_sandbox)
    await asyncio.to_thread(grammars.start)
    limits = RequestLimits(max_prompt_tokens=settings.max_prompt_tokens, max_tokens=settings.max_tokens)
    app.state.handlers = OpenAIHandlers(
        parts.model,
        dispatcher,
        parts.metrics,
        limits,
        parts.tracing,
        grammars,
        settings.grammar_limits,
        parts.access,
    )
    store = settings.response_store
    event_limits = EventLimits(max_events=store.max_events, max_bytes=store.max_event_bytes)
    app.state.responses = ResponsesHandler(app.state.handlers, parts.responses, event_limits)
    app.state.responses.runs.on_adopted = parts.metrics.background_adoptions.inc
    app.state.responses.tenancy = parts.tenancy  # an adopted response runs for the tenant kept with it
    app.state.discovery = Discovery(
        parts.registry,
        http,
        settings.discovery,
        model_fingerprint(settings.model_path),
        parts.metrics,
        settings.drain_timeout_s,
    )


def _background_tasks(
    app: FastAPI,
    parts: RouterParts,
    client: WorkerClient | None,
    health_http: httpx.AsyncClient,
    events_http: httpx.AsyncClient,
) -> list[asyncio.Task]:
    """Health checks and discovery on the health connections, the KV index's event streams (or
    polls) on their own, the sweep for background responses whose router is gone (none of these with a
    unit test's client), and the stats line."""
    settings = parts.settings
    tasks = []
    if client is None:
        tasks += [
            asyncio.create_task(parts.registry.run(health_http)),
            asyncio.create_task(app.state.discovery.run()),
        ]
        if parts.kv_index is not None:
            follower = (
                KvEventStreams(parts.registry, parts.kv_index, events_http)
                if settings.kv_events == "push"
                else KvEventPoller(parts.registry, parts.kv_index, events_http, settings.kv_events_interval_s)
            )
            tasks.append(asyncio.create_task(follower.run()))
        tasks.append(asyncio.create_task(app.state.responses.runs.sweep()))  # background responses orphaned
    if settings.log_stats_interval_s > 0:
        stats = log_stats(parts.snapshot, router_line, settings.log_stats_interval_s)  # type: ignore[arg-type]
        tasks.append(asyncio.create_task(stats))
    return tasks


def create_app(
    settings: RouterSettings, model: ServedModel | None = None, client: WorkerClient | None = None
) -> FastAPI:
    """``model`` and ``client`` (a WorkerClient look-alike) may be given by unit tests.

    ``app.state.drain`` is what SIGTERM starts (``server_common.run.serve``):
    new requests then get 503, requests in flight or waiting for a slot finish.
    """
    model = model or ServedModel.load(settings.served_model_name, settings.model_path, settings.max_model_len)
    parts = RouterParts.build(settings, model)
    app = FastAPI(title="pdserve router", lifespan=lifespan(parts, client))
    app.router.route_class = StrictJSONRoute  # NaN and Infinity are not JSON (server_common/strict_json.py)
    openapi.install(
        app,
        vocab_size=model.vocab_size,
        api_keys=bool(settings.api_keys),
        max_new_tokens=min(settings.max_tokens or model.max_model_len - 1, model.max_model_len - 1),
    )
    app.state.drain = parts.drain
    app.state.connections = parts.connections
    app.state.registry = parts.registry
    app.state.kv_index = parts.kv_index
    app.add_middleware(BodyCapMiddleware, max_bytes=settings.max_body_bytes, refusal_body=openai_413)
    app.state.trimmer = Trimmer()
    app.add_middleware(TrimAfterLargeRequests, trimmer=app.state.trimmer)  # their memory back to the system
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, a 413 too, has an id
    install_error_handlers(app)
    add_openai_routes(app, parts)
    move_off = (lambda name: app.state.handlers.dispatcher.move_off(name)) if settings.drain == "migrate" else None
    add_admin_routes(app, parts.registry, parts.auth.admin, lambda: app.state.discovery, move_off)
    add_operator_routes(app, parts)
    return app


async def respond(
    parts: RouterParts,
    request: Request,
    endpoint: str,
    call: Callable[[str, str | None, int], Awaitable[Answered]],
) -> Response:
    """A generation route's answer: the caller checked, the request counted in flight and then by
    its status (a refusal into the access log), the handler's answer as JSON or as a stream of
    server-sent events. ``call(request_id, traceparent, body_bytes)``: the handler's coroutine."""
    metrics, access = parts.metrics, parts.access
    rid = request_id_of(request)
    try:
        parts.auth.client(request)
        caller = parts.tenancy.caller(parts.auth.key(request), request.headers.get(PRIORITY_HEADER))
    except OpenAIError as exc:
        access.refused(rid, endpoint, exc.status, exc.code)
        metrics.tenant_answered(parts.tenancy.tenant(parts.auth.key(request)).settings.name, exc.status)
        raise
    metrics.inflight.inc()
    status, code = 500, None
    token = tenancy.CURRENT.set(caller)
    try:
        answer = await until_disconnect(
            request, call(rid, request.headers.get("traceparent"), len(await request.body()))
        )
        status = 200
    except OpenAIError as exc:
        status, code = exc.status, exc.code
        raise
    finally:
        tenancy.CURRENT.reset(token)
        metrics.inflight.dec()
        metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        metrics.tenant_answered(caller.ticket.tenant, status)
        if status != 200:
            access.refused(rid, endpoint, status, code)
    limits = parts.tenancy.headers(caller.tenant) if caller.tenant is not None else {}
    if answer[0] is None:
        answer[1].headers.update(limits)
        return answer[1]  # encoded by the handler (off the event loop when large)
    session, result = answer
    # session.close is idempotent: the stream closes it in `finally`, the
    # background task covers a client that left before the first chunk.
    return EventStream(result, headers=limits, background=BackgroundTask(session.close))


def add_openai_routes(app: FastAPI, parts: RouterParts) -> None:
    """The OpenAI API: thin routes over ``OpenAIHandlers`` (router/api/openai_handlers.py)."""

    @app.post("/v1/chat/completions", responses=openapi.generation_responses(out.ChatCompletion, "ChatCompletionChunk"))
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await respond(parts, request, "chat", lambda *args: request.app.state.handlers.chat(req, *args))

    @app.post("/v1/completions", responses=openapi.generation_responses(out.Completion, "Completion"))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        handlers = request.app.state.handlers
        return await respond(parts, request, "completions", lambda *args: handlers.completion(req, *args))

    @app.get("/v1/models", responses=openapi.ok(out.ModelList, "The served model.") | openapi.errors(401, 500))
    async def models(request: Request) -> JSONResponse:
        parts.auth.client(request)
        return JSONResponse(request.app.state.handlers.models().model_dump())

    @app.get(
        "/v1/models/{model:path}",
        responses=openapi.ok(out.ModelCard, "The served model's card.") | openapi.errors(401, 404, 500),
    )
    async def model_card(model: str, request: Request) -> JSONResponse:
        """The SDK's ``client.models.retrieve(id)``; ids may contain '/' (``org/name``)."""
        parts.auth.client(request)
        return JSONResponse(request.app.state.handlers.model_card(model).model_dump())

    add_responses_routes(app, parts)
    add_tokenizer_routes(app, parts)


def add_responses_routes(app: FastAPI, parts: RouterParts) -> None:
    """The Responses API (router/api/responses.py): create, get (or stream again), cancel, delete, input items."""

    @app.post(
        "/v1/responses",
        responses=openapi.answered(
            "A response object; with `stream: true`, its typed events (`response.created` ... `response.completed`).",
            events="one typed event as JSON (its `type` is also the SSE `event:` line); `error` if the request "
            "fails mid-stream",
        )
        | openapi.errors(400, 401, 404, 413, 429, 500, 503),
    )
    async def create_response(req: ResponsesRequest, request: Request) -> Response:
        owner = parts.auth.owner(request)
        responses = request.app.state.responses
        return await respond(parts, request, "responses", lambda *args: responses.create(req, owner, *args))

    @app.get(
        "/v1/responses/{response_id}",
        responses=openapi.answered(
            "The stored response; with `stream=true`, a background response's events after `starting_after`.",
            events="one typed event as JSON, as POST /v1/responses streams them",
        )
        | openapi.errors(400, 401, 404, 500),
    )
    async def get_response(
        response_id: str, request: Request, stream: bool = False, starting_after: int | None = None
    ) -> Response:
        """``stream``: a background response's events numbered above ``starting_after`` (all without it),
        the stored ones and then the live ones until its last (router/api/background.py)."""
        parts.auth.client(request)
        owner = parts.auth.owner(request)
        if stream:
            events = await request.app.state.responses.events(response_id, owner, starting_after)
            return EventStream(events)
        stored = await request.app.state.responses.get(response_id, owner)
        return JSONResponse(stored.response)

    @app.post(
        "/v1/responses/{response_id}/cancel",
        responses=openapi.answered("The response, `cancelled` (or as it ended, if it had).")
        | openapi.errors(400, 401, 404, 500),
    )
    async def cancel_response(response_id: str, request: Request) -> JSONResponse:
        """Stops a background response: its work on the servers ends, as on a client's disconnect."""
        parts.auth.client(request)
        return JSONResponse(await request.app.state.responses.cancel(response_id, parts.auth.owner(request)))

    @app.delete(
        "/v1/responses/{response_id}",
        responses=openapi.answered("`{id, object, deleted: true}`.") | openapi.errors(401, 404, 500),
    )
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        parts.auth.client(request)
        return JSONResponse(await request.app.state.responses.delete(response_id, parts.auth.owner(request)))

    @app.get(
        "/v1/responses/{response_id}/input_items",
        responses=openapi.answered("A list of the response's input items.") | openapi.errors(400, 401, 404, 500),
    )
    async def response_input_items(
        response_id: str, request: Request, order: Literal["asc", "desc"] = "desc"
    ) -> JSONResponse:
        """This turn's input items (``order``: desc, OpenAI's default, or asc)."""
        parts.auth.client(request)
        stored = await request.app.state.responses.get(response_id, parts.auth.owner(request))
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        return JSONResponse(
            {
                "object": "list",
                "data": items,
                "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None,
                "has_more": False,
            }
        )


def add_tokenizer_routes(app: FastAPI, parts: RouterParts) -> None:
    """vLLM's tokenizer endpoints (evaluation harnesses probe them)."""

    @app.post(
        "/tokenize",
        responses=openapi.answered("`{count, max_model_len, tokens}`.") | openapi.errors(400, 401, 404, 413, 500),
    )
    async def tokenize(req: TokenizeRequest, request: Request) -> JSONResponse:
        parts.auth.client(request)
        return JSONResponse(tokenize_answer(parts.model, req))

    @app.post("/detokenize", responses=openapi.answered("`{prompt}`.") | openapi.errors(400, 401, 404, 413, 500))
    async def detokenize(req: DetokenizeRequest, request: Request) -> JSONResponse:
        parts.auth.client(request)
        return JSONResponse(detokenize_answer(parts.model, req))


def add_operator_routes(app: FastAPI, parts: RouterParts) -> None:
    """Health, metrics and the debug views (admin callers only)."""
    registry, drain, kv_index = parts.registry, parts.drain, parts.kv_index

    @app.get("/health", responses=openapi.HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        workers = [
            openapi.WorkerHealth(name=w.name, role=w.role, url=w.url, healthy=w.healthy, in_rotation=w.in_rotation)
            for w in registry.workers
        ]
        ok = bool(registry.healthy("decode")) and not drain.draining
        status: openapi.HealthStatus = "draining" if drain.draining else "ok" if ok else "degraded"
        body = openapi.Health(status=status, workers=workers, launch_id=parts.settings.launch_id)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS_RESPONSES)
    async def prometheus() -> Response:
        return Response(generate_latest(parts.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # Admin and debug routes stay out of the published document (router/api/openapi.py says why).
    @app.get("/debug/timeline", include_in_schema=False)
    async def timeline(request: Request) -> JSONResponse:
        """Stage timestamps of the last requests (server_common/timeline_log.py); admin callers only."""
        parts.auth.admin(request)
        return JSONResponse(
            {"instance": "router", "role": "router", "requests": request.app.state.handlers.timeline.entries()}
        )

    @app.get("/debug/kv_index", include_in_schema=False)
    async def kv_index_state(request: Request) -> JSONResponse:
        """What the router knows of each server's cached blocks (router/cluster/kv_index.py); admin callers only."""
        parts.auth.admin(request)
        workers = (
            {}
            if kv_index is None
            else {
                name: {
                    "epoch": idx.epoch,
                    "seq": idx.seq,
                    "blocks": len(idx.hashes),
                    "tiered_blocks": len(idx.tiered),
                    "block_size": idx.block_size,
                    "resyncs": idx.resyncs,
                }
                for name, idx in kv_index.workers.items()
            }
        )
        return JSONResponse({"enabled": kv_index is not None, "workers": workers})
