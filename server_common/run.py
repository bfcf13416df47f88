"""Serving a process's app: logging, and uvicorn with a SIGTERM that drains first.

deploy/process_cli.py reads the cluster config and hands each process its
settings; nothing here reads the config.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from server_common.guard import Drain
from server_common.process_defaults import DRAIN_TIMEOUT_S

log = logging.getLogger(__name__)


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    if level != "debug":  # one line per health check and per request is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains before shutting down.

    On SIGTERM the app stops taking new work (``drain.draining``: new requests
    get a clear refusal) while its listener stays open, so calls about work in
    flight (aborts, KV handshakes, health checks) still arrive; once nothing is
    in flight, or ``timeout`` passed, uvicorn shuts down as usual. Another
    signal, or SIGINT, is uvicorn's own handling (a second one forces the exit).
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sigterm_seen = False
        self._drain_task: asyncio.Task | None = None  # kept so the task is not collected while it runs

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or self._loop is None or self._sigterm_seen or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._sigterm_seen = True
        self._drain.start()
        self._loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: int) -> None:
        log.info("SIGTERM: draining (%d in flight, up to %.0f s)", self._drain.inflight, self._timeout)
        if await self._drain.wait_idle(self._timeout):
            log.info("drained; shutting down")
        else:
            log.warning("still %d in flight after %.0f s; shutting down anyway", self._drain.inflight, self._timeout)
        super().handle_exit(sig, None)


def serve(
    app,
    host: str,
    port: int,
    log_level: str,
    drain: Drain | None = None,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    http: type | str = "auto",
    keep_alive_s: float = 5.0,
) -> None:
    """Run ``app`` until a signal; with ``drain``, SIGTERM drains first (see ``DrainingServer``).
    ``http``: uvicorn's protocol (a ``server_common.connections`` guard's, on every server);
    ``keep_alive_s``: how long an idle kept-alive connection stays open."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=3,
        http=http,
        timeout_keep_alive=keep_alive_s,
    )
    server = DrainingServer(config, drain, drain_timeout_s) if drain is not None else uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        raise SystemExit(3)  # as uvicorn.run: the app or the socket failed at start
