"""router/cluster/kv_events.py, push: the router follows each worker through its event stream.
The workers are real HTTP servers on 127.0.0.1 (uvicorn, in threads) serving the servers'
own stream (server_common/kv_event_stream.py) and snapshot from real event logs."""

from __future__ import annotations

import asyncio
import threading

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from bench.load.cluster import free_ports
from engine.kv_events import KvEventLog
from router.cluster.kv_events import KvEventStreams
from router.cluster.kv_index import KvIndex
from router.cluster.registry import Worker, WorkerRegistry
from server_common.kv_event_stream import Changes, event_stream
from tests.support.kv_indexes import snapshot
from tests.waiting import until, wait_until


class EventServer:
    """One worker's /kv/blocks and /kv/events/stream over ``log`` (which a test may replace: a restart)."""

    def __init__(self, log: KvEventLog, port: int | None = None) -> None:
        self.log = log
        self.streams_opened = 0
        self.stopping = False  # as a server's drain before it exits: its streams end
        self.changes: Changes | None = None
        app = FastAPI()

        @app.get("/kv/blocks")
        async def blocks() -> Response:
            return Response(snapshot(self.log).model_dump_json(), media_type="application/json")

        @app.get("/kv/events/stream")
        async def events(after: int = 0) -> StreamingResponse:
            self.streams_opened += 1
            if self.changes is None:  # one per server, as the servers' app keeps it
                self.changes = Changes(self.log, asyncio.get_running_loop())
            changes = self.changes
            pages = event_stream(
                self.log, changes, after, block_size=4, salt="s", enabled=True, heartbeat_s=0.2, ended=self.ended
            )
            return StreamingResponse(pages, media_type="application/x-ndjson")

        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        until_sync(lambda: self.server.started, "the server up")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ended(self) -> bool:
        return self.stopping

    def stop(self) -> None:
        self.stopping = True
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def until_sync(predicate, what: str) -> None:
    wait_until(predicate, 10.0, what)


class Followed:
    """One worker serving ``log`` (``server``, replaced to restart it on its port) and the router's
    ``KvEventStreams`` following it into ``index`` while ``follow(steps)`` runs; stopped by the end."""

    def __init__(self, log: KvEventLog) -> None:
        self.server = EventServer(log)
        self.port = self.server.port
        self.registry = WorkerRegistry([Worker("d0", "decode", self.server.url)])
        self.index = KvIndex()

    async def restart(self, log: KvEventLog) -> None:
        await asyncio.to_thread(self.server.stop)
        self.server = await asyncio.to_thread(EventServer, log, self.port)

    def follow(self, steps) -> None:
        async def run():
            async with httpx.AsyncClient() as http:
                follower = asyncio.create_task(KvEventStreams(self.registry, self.index, http, retry_s=0.05).run())
                try:
                    await steps(self)
                finally:
                    follower.cancel()
                    await asyncio.gather(follower, return_exceptions=True)

        try:
            asyncio.run(run())
        finally:
            self.server.stop()


def test_a_worker_is_loaded_then_followed_and_a_restart_is_loaded_again():
    log = KvEventLog(epoch="e1")
    log.stored(11)
    f = Followed(log)

    async def steps(f: Followed) -> None:
        d0 = f.index.of
        await until(lambda: d0("d0").hashes == {11}, 10.0, "the snapshot loaded")
        log.stored(22)  # pushed: no poll asks for it
        log.evicted(11)
        await until(lambda: d0("d0").hashes == {22}, 10.0, "events pushed")
        assert d0("d0").resyncs == 1 and f.server.streams_opened == 1
        restarted = KvEventLog(epoch="e2")  # a new process: another epoch, its own numbers
        restarted.stored(99)
        await f.restart(restarted)
        await until(lambda: d0("d0").epoch == "e2", 10.0, "the restarted log loaded")
        restarted.stored(100)
        await until(lambda: d0("d0").hashes == {99, 100}, 10.0, "followed again")
        assert d0("d0").resyncs == 2
        f.registry.forget("d0")
        await until(lambda: "d0" not in f.index.workers, 10.0, "a forgotten worker dropped")

    f.follow(steps)
    assert f.index.workers == {}


def test_a_worker_that_goes_away_is_followed_again_when_it_comes_back():
    log = KvEventLog(epoch="e1")
    log.stored(1)
    f = Followed(log)

    async def steps(f: Followed) -> None:
        await until(lambda: f.index.of("d0").hashes == {1}, 10.0, "loaded")
        await asyncio.to_thread(f.server.stop)
        log.stored(2)  # while it is away
        f.server = await asyncio.to_thread(EventServer, log, f.port)
        await until(lambda: f.index.of("d0").hashes == {1, 2}, 10.0, "followed after the gap")

    f.follow(steps)
    assert f.index.of("d0").resyncs == 1  # the same epoch: the events after its seq, no snapshot
