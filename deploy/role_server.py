"""One server process whose role changes in place: prefill <-> decode (and colocated), one engine.

`pdserve prefill` and `pdserve decode` run a ``RoleServer``: the engine (weights, KV cache,
prefix cache) and its engine thread are built once; each role is the role's own service
(``prefill_server.service.PrefillService`` or ``decode_server.service.GenerationService``)
and app over that engine, exactly as a single-role server has them. ``POST /admin/role
{"role": "decode"}`` (behind the internal secret, as every admin route) switches:

1. the current service drains: a decode server's streams end with "draining" and the router
   continues them elsewhere (migration), a prefill server finishes the transfers it started;
   new work is refused meanwhile (503 ``draining``, which the router retries elsewhere);
2. once nothing of a request is left (``quiet()``: no stream, reservation, job, open transfer
   or engine request), the engine thread is handed to the new role's service (``EngineThread.
   rebind``), the old role's KV link is closed (a decode server's receiver, a prefill server's
   sender), the engine's mode flips (``LLMEngine.set_mode``) and the new role's service starts
   with its own link (a decode server's receiver listens on the instance's ``kv_port``, with a
   new transfer epoch, so prefill servers meet it afresh);
3. the role epoch goes up by one; /health reports ``role`` and ``role_epoch``.

Stale work is refused, never half-served (409, ``wire.replies.ErrorReply``): a call for a path
of another role (``/prefill`` or ``/admin/peers`` at a decode server, ``/generate`` or
``/kv/hello`` at a prefill server) gets ``wrong_role``; a call whose ``x-pdserve-role-epoch``
header (``wire.names.ROLE_EPOCH_HEADER``, sent by the router) names another epoch gets
``stale_epoch``. A call without the header is served as before. A reservation of the old
role's receiver names that receiver's transfer epoch and ids, which the new receiver does not
know: its writes are refused by the transfer layer.

Refused: an unknown role (400), a switch while one runs (409 ``switch_in_progress``), a
tensor-parallel server (409: its ranks hold transfer agents of the role they started in), a
draining (shutting down) server (503). A drain that does not end within ``drain_timeout_s``
gives the switch up: the old role resumes (503 ``switch_in_progress``). Should the new role
fail to start, the old one is started again; should that fail too, the process ends with
``EXIT_SWITCH_FAILED`` and its supervisor (``deploy/supervisor.py``) starts it again in its
configured role.

Restarts: under ``pdserve launch`` the server records its role and epoch in its role file
(``deploy/role_file.py``, ``--role-file``, in the run folder) when it starts, when a drained
switch commits to the new role (before the old role's link closes), when a failed switch restores
the old role, and (its configured role) before ``EXIT_SWITCH_FAILED``. A process that dies after a
switch, or in one past its drain, is started again directly in the role it was switched to (the
one the planner or the operator last decided), in the epoch after the recorded one: stale
reservations and calls of its earlier life are still refused, and the router, seeing a new
epoch, joins it again in that role (``router.cluster.discovery.Discovery.readmit``). One that
dies while still draining comes back in its old role, which the router joins again just as
well. A Kubernetes pod has no run folder: a restarted container starts in its configured role
at epoch 0, the router joins it again in that role, and the planner decides its role anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any, cast

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from deploy.role_file import RoleFile, RoleRecord, resumed
from engine import LLMEngine
from engine.config import MODES, EngineMode
from server_common.engine_thread import EngineThread
from server_common.faults import FaultInjector
from server_common.guard import Drain, InternalAuthMiddleware
from server_common.metrics import ServerMetrics
from server_common.settings import ServerSettings
from transfer.outcome import Outcome
from wire.names import ROLE_EPOCH_HEADER
from wire.replies import ErrorReply

log = logging.getLogger(__name__)
EXIT_SWITCH_FAILED = 71  # EX_OSERR: neither the new role nor the old one could start again
QUIET_POLL_S = 0.02
ROLE_PATH = "/admin/role"
# The paths only some roles serve (every other path is common to all).
ROLE_PATHS: dict[str, frozenset[str]] = {
    "/prefill": frozenset({"prefill"}),
    "/admin/peers": frozenset({"prefill"}),
    "/generate": frozenset({"decode", "colocated"}),
    "/kv/hello": frozenset({"decode"}),
}
Scope = dict[str, Any]
ASGI = Callable[..., Any]


def roles_serving(path: str) -> frozenset[str] | None:
    """The roles that serve ``path``; None for a path every role serves."""
    if path.startswith("/admin/peers/"):
        path = "/admin/peers"
    return ROLE_PATHS.get(path)


class SwitchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = Field(max_length=32)  # checked against engine.config.MODES: 400 names the roles


class SwitchRefused(Exception):
    def __init__(self, status: int, message: str, code: Outcome) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclasses.dataclass
class RoleService:
    """One role's service and app over the shared engine; ``stack`` holds its app's lifespan while it runs."""

    role: EngineMode
    service: Any
    app: FastAPI
    stack: contextlib.AsyncExitStack | None = None


class FollowingDrain(Drain):
    """The drain SIGTERM starts (``server_common.run.DrainingServer``): whichever role's service runs
    now drains, and so does one that a switch starts later."""

    def __init__(self, current: Callable[[], Drain]) -> None:
        super().__init__(lambda: current().inflight)
        self._current = current

    def start(self) -> None:
        super().start()
        self._current().start()

    def resume(self) -> None:
        super().resume()
        self._current().resume()


class RoleServer:
    """The process's ASGI app (see the module): the current role's app, the role switch route, and
    the refusals of stale calls. ``make(role, settings, engine_thread, epoch)`` builds a role's service
    and its app. ``start``: the role and epoch it starts in (default: its configured role, epoch 0), whose
    engine ``engine`` is built in; ``role_file``: where it records its role (``deploy.role_file``)."""

    def __init__(
        self,
        settings: ServerSettings,
        engine: LLMEngine,
        make: Callable[[EngineMode, ServerSettings, EngineThread, int], tuple[Any, FastAPI]],
        start: RoleRecord | None = None,
        role_file: RoleFile | None = None,
    ) -> None:
        start = start or RoleRecord(settings.role, 0)
        self.settings = settings
        self.engine = engine
        self.epoch = start.role_epoch
        self.role_file = role_file
        self.switches: list[dict[str, Any]] = []  # each switch's figures, newest last (at most 32)
        self._make = make
        self.engine_thread = EngineThread(engine, lambda e, outputs: None, settings.name)
        self._current = self._build(start.role)
        self._record(start)
        self._switching: asyncio.Lock = asyncio.Lock()
        self.drain = FollowingDrain(lambda: self._current.service.drain)
        self._control = InternalAuthMiddleware(self._control_app(), settings.internal_secret)
        self._refuse = InternalAuthMiddleware(self._refusal, settings.internal_secret)

    @property
    def role(self) -> EngineMode:
        return self._current.role

    @property
    def service(self) -> Any:
        return self._current.service

    def _build(self, role: EngineMode) -> RoleService:
        engine = dataclasses.replace(self.settings.engine, mode=role)
        settings = dataclasses.replace(self.settings, role=role, engine=engine)
        service, app = self._make(role, settings, self.engine_thread, self.epoch)
        return RoleService(role, service, app)

    # ---- ASGI ------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: ASGI, send: ASGI) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "http":
            if scope["path"] == ROLE_PATH:
                await self._control(scope, receive, send)
                return
            if self.refusal(scope) is not None:
                await self._refuse(scope, receive, send)
                return
        await self._current.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, ErrorReply] | None:
        """Why a call is refused before it reaches the role's app (see the module); None: it is served."""
        name, role, epoch = self.settings.name, self._current.role, self.epoch
        serving = roles_serving(scope["path"])
        if serving is not None and role not in serving:
            message = f"{name} is a {role} server now (role epoch {epoch}): {scope['path']} is not served"
            return 409, ErrorReply(error=message, code=Outcome.WRONG_ROLE)
        header = ROLE_EPOCH_HEADER.encode()
        sent = next((v for k, v in scope.get("headers", ()) if k == header), None)
        if sent is None:
            return None
        if not sent.isdigit():
            return 400, ErrorReply(error=f"{ROLE_EPOCH_HEADER} must be a whole number", code=Outcome.BAD_REQUEST)
        if int(sent) != epoch:
            message = f"{name} is in role epoch {epoch} ({role}), the call was for epoch {int(sent)}"
            return 409, ErrorReply(error=message, code=Outcome.STALE_EPOCH)
        return None

    async def _refusal(self, scope: Scope, receive: ASGI, send: ASGI) -> None:
        refused = self.refusal(scope)
        if refused is None:  # the switch ended between the check and the secret's check
            await self._current.app(scope, receive, send)
            return
        status, reply = refused
        await JSONResponse(reply.model_dump(mode="json"), status_code=status)(scope, receive, send)

    async def _lifespan(self, receive: ASGI, send: ASGI) -> None:
        await receive()  # lifespan.startup
        try:
            await self._enter(self._current)
        except BaseException as exc:
            log.exception("the server did not start")
            await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        async with self._switching:  # a switch in flight ends first
            await self._leave(self._current)
        self.engine_thread.stop()
        await send({"type": "lifespan.shutdown.complete"})

    async def _enter(self, role: RoleService) -> None:
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(role.app.router.lifespan_context(role.app))
        role.stack = stack

    @staticmethod
    async def _leave(role: RoleService) -> None:
        stack, role.stack = role.stack, None
        if stack is not None:
            await stack.aclose()

    # ---- switching ---------------------------------------------------------------------
    def _record(self, record: RoleRecord) -> None:
        """The role a restart of this process starts in (see the module); nothing without a role file."""
        if self.role_file is not None:
            self.role_file.write(record)

    def describe(self) -> dict[str, Any]:
        return {
            "instance": self.settings.name,
            "role": self.role,
            "role_epoch": self.epoch,
            "configured_role": self.settings.role,
            "switching": self._switching.locked(),
            "switches": self.switches[-8:],
        }

    async def switch(self, role: str) -> dict[str, Any]:
        """Drain the current role, take the engine into ``role``, bump the epoch (see the module);
        raises ``SwitchRefused``."""
        if role not in MODES:
            raise SwitchRefused(400, f"unknown role {role[:32]!r}: one of {list(MODES)}", Outcome.BAD_REQUEST)
        if self._switching.locked():
            raise SwitchRefused(409, f"{self.settings.name} is already changing role", Outcome.SWITCHING)
        if self.drain.draining:
            raise SwitchRefused(503, f"{self.settings.name} is shutting down", Outcome.DRAINING)
        if self.engine.ranks is not None:
            message = "a tensor-parallel server keeps the role it started in (its ranks hold its KV link)"
            raise SwitchRefused(409, message, Outcome.BAD_REQUEST)
        async with self._switching:
            if role == self.role:
                return self.describe() | {"changed": False}
            figures = await self._switch(cast(EngineMode, role))
        return self.describe() | figures

    async def _switch(self, role: EngineMode) -> dict[str, Any]:
        old, started = self._current, time.monotonic()
        log.info("switching from %s to %s (role epoch %d)", old.role, role, self.epoch)
        old.service.drain.start()  # a decode server's streams move off; new work is refused
        if not await self._wait_quiet(old.service, self.settings.drain_timeout_s):
            if not self.drain.draining:
                old.service.drain.resume()
            message = f"{self.settings.name} still had work after {self.settings.drain_timeout_s:g} s of draining"
            raise SwitchRefused(503, f"{message}; it stays a {old.role} server", Outcome.SWITCHING)
        drained = time.monotonic()
        self._record(RoleRecord(role, self.epoch + 1))  # from here on, a restart completes the switch
        # The old service is quiet: nothing runs on the engine thread while it is handed on.
        await self.engine_thread.run(lambda e: self.engine_thread.rebind(lambda e, outputs: None))
        await self._leave(old)  # its KV link closes (a decode server's port is free again)
        try:
            await self.engine_thread.run(lambda e: e.set_mode(role))
            self.epoch += 1
            new = self._build(role)
            await self._enter(new)
        except Exception as exc:
            log.exception("the %s role did not start; back to %s", role, old.role)
            await self._restore(old.role)
            message = f"the {role} role did not start ({exc!r}); it is a {old.role} server again"
            raise SwitchRefused(500, message, Outcome.SWITCHING) from exc
        self._current = new
        if self.drain.draining:  # SIGTERM while switching: the new role drains too
            new.service.drain.start()
        done = time.monotonic()
        figures = {
            "from": old.role,
            "to": role,
            "role_epoch": self.epoch,
            "seconds": round(done - started, 4),
            "drain_seconds": round(drained - started, 4),
        }
        self.switches = [*self.switches[-31:], figures]
        log.info("now a %s server (role epoch %d) after %.3f s", role, self.epoch, done - started)
        return {"changed": True, "seconds": figures["seconds"], "previous_role": old.role}

    async def _restore(self, role: EngineMode) -> None:
        """Back in ``role`` after a failed switch, a new epoch; the process ends if even that fails."""
        try:
            if self.engine.config.mode != role:  # a switch that failed before the mode changed left it
                await self.engine_thread.run(lambda e: e.set_mode(role))
            self.epoch += 1
            self._record(RoleRecord(role, self.epoch))
            back = self._build(role)
            await self._enter(back)
            self._current = back
        except Exception:
            log.exception("nor did the %s role start again; exiting for the supervisor", role)
            self._record(RoleRecord(self.settings.role, self.epoch))  # restarted as configured
            os._exit(EXIT_SWITCH_FAILED)

    async def _wait_quiet(self, service: Any, timeout: float) -> bool:
        """True once ``service`` holds nothing of a request and neither does the engine (asked on its
        thread: the stats it publishes lag a round behind); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not (service.quiet() and await self.engine_thread.run(lambda e: not e.scheduler.requests)):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(QUIET_POLL_S)
        return True

    def _control_app(self) -> FastAPI:
        app = FastAPI(title=f"pdserve {self.settings.name} role")

        @app.get(ROLE_PATH)
        async def current() -> JSONResponse:
            """This instance's role, role epoch and recent switches."""
            return JSONResponse(self.describe())

        @app.post(ROLE_PATH)
        async def switch(body: SwitchRequest) -> JSONResponse:
            """Switch this instance to ``body.role`` in place (see the module)."""
            try:
                return JSONResponse(await self.switch(body.role))
            except SwitchRefused as exc:
                reply = ErrorReply(error=exc.message, code=exc.code)
                headers = {"Retry-After": "1"} if exc.status == 503 else {}
                return JSONResponse(reply.model_dump(mode="json"), status_code=exc.status, headers=headers)

        return app


def make_role(
    settings: ServerSettings, engine: LLMEngine, faults: FaultInjector | None, guard: Any
) -> Callable[[EngineMode, ServerSettings, EngineThread, int], tuple[Any, FastAPI]]:
    """What builds each role's service and app over ``engine`` (the KV link of the role, built from
    the role's settings). Every role's service counts in the same metrics, made with the first (the
    engine thread is the same one, handed on): a switch never sends a counter back to zero. ``guard``
    (the connection guard) reports in them."""
    metrics: ServerMetrics | None = None

    def make(role: EngineMode, role_settings: ServerSettings, thread: EngineThread, epoch: int) -> tuple[Any, FastAPI]:
        nonlocal metrics
        if metrics is None:
            metrics = ServerMetrics(lambda: thread.stats)
            metrics.registry.register(guard)
        service: Any
        if role == "prefill":
            from kvlink.factory import prefill_link_factory
            from prefill_server.app import create_app as prefill_app
            from prefill_server.service import PrefillService

            link = prefill_link_factory(role_settings, engine, faults)
            service = PrefillService(
                role_settings, engine, link, faults, engine_thread=thread, role_epoch=epoch, metrics=metrics
            )
            app = prefill_app(service)
        else:
            from decode_server.app import create_app as decode_app
            from decode_server.service import GenerationService
            from kvlink.factory import receiver_factory

            receiver = receiver_factory(role_settings, engine, faults) if role == "decode" else None
            service = GenerationService(
                role_settings, engine, receiver, faults, engine_thread=thread, role_epoch=epoch, metrics=metrics
            )
            app = decode_app(service)
        return service, app

    return make


def run(settings: ServerSettings, log_level: str, role_file: RoleFile | None = None) -> int:
    """`pdserve prefill|decode`'s process: a ``RoleServer`` in the role ``role_file`` recorded (a restart
    under ``pdserve launch``), or else the configured role (``deploy.role_file.resumed``)."""
    from server_common.kernel_cache import bound_kernel_caches

    bound_kernel_caches()  # before the engine's first oneDNN kernel (server_common/kernel_cache.py)
    from kvlink.factory import RANK_AGENT
    from server_common.connections import server_guard
    from server_common.engine_thread import build_engine
    from server_common.run import serve

    start = resumed(role_file, settings.role)
    if start.role != settings.role:
        log.info("starting as a %s server (role epoch %d), the role it was last in", start.role, start.role_epoch)
    # ranks hold their KV senders or receivers
    engine = build_engine(dataclasses.replace(settings.engine, mode=start.role), RANK_AGENT)
    faults = FaultInjector() if settings.fault_injection else None
    guard = server_guard(settings)
    server = RoleServer(settings, engine, make_role(settings, engine, faults, guard), start, role_file)
    serve(
        server,
        settings.listen_host,
        settings.port,
        log_level,
        server.drain,
        settings.drain_timeout_s,
        http=guard.protocol_class(),
    )
    return 0
