"""Every worker's block-hash events into the router's ``KvIndex`` (router/cluster/kv_index.py).

Two ways, one index (``router.kv_events``):

- ``push`` (the default), ``KvEventStreams``: one long-lived ``GET /kv/events/stream?after=SEQ`` per
  worker in rotation (server_common/kv_event_stream.py), whose NDJSON pages arrive as the worker's
  engine adds events, with an empty page each second on a quiet one. Nothing polls: N routers in
  front of M workers cost each worker N open streams and one encoding per batch.
- ``poll``, ``KvEventPoller``: every ``interval`` seconds each worker in rotation is asked
  ``GET /kv/events?after=SEQ``.

Either way (internal routes: the client carries the cluster's secret), a page the index refuses
(new epoch, or events lost) is followed at once by ``GET /kv/blocks``. A worker that does not
answer keeps its index as it was: it is out of rotation or will be, and when it comes back
restarted its epoch tells. A worker the registry forgot is dropped from the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
from pydantic import ValidationError

from router.cluster.kv_index import KvIndex, WorkerKvIndex
from router.cluster.registry import Worker, WorkerRegistry
from wire.replies import KvBlocksReply, KvEventsReply

log = logging.getLogger(__name__)


class KvEventPoller:
    def __init__(
        self, registry: WorkerRegistry, index: KvIndex, http: httpx.AsyncClient, interval: float = 0.2
    ) -> None:
        self.registry = registry
        self.index = index
        self.http = http
        self.interval = interval

    async def poll_once(self) -> None:
        known = {w.name for w in self.registry.workers}
        for name in [n for n in self.index.workers if n not in known]:
            self.index.forget(name)
        await asyncio.gather(*(self._poll(w) for w in self.registry.workers if w.in_rotation))

    async def _poll(self, worker: Worker) -> None:
        idx = self.index.of(worker.name)
        try:
            if not idx.stale:
                resp = await self.http.get(f"{worker.url}/kv/events", params={"after": idx.seq}, timeout=2.0)
                resp.raise_for_status()
                if idx.apply(KvEventsReply.model_validate_json(resp.content)):
                    return
                log.info("kv index of %s: events lost or server restarted; loading its blocks", worker.name)
            resp = await self.http.get(f"{worker.url}/kv/blocks", timeout=5.0)
            resp.raise_for_status()
            idx.load(KvBlocksReply.model_validate_json(resp.content))
        except (httpx.HTTPError, ValidationError) as exc:
            log.debug("kv events of %s: %s", worker.name, exc)

    async def run(self) -> None:
        """Poll forever (cancel the task to stop)."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)


class KvEventStreams:
    """Follows each worker in rotation through its event stream. ``retry_s``: the wait before a
    broken stream is opened again, and how often the set of workers followed is checked."""

    STREAM_READ_S = 5.0  # a stream silent this long (5 heartbeats) is broken

    def __init__(self, registry: WorkerRegistry, index: KvIndex, http: httpx.AsyncClient, retry_s: float = 1.0) -> None:
        self.registry = registry
        self.index = index
        self.http = http
        self.retry_s = retry_s
        self.pages = 0  # pages applied, in all
        self._following: dict[str, asyncio.Task] = {}

    def sync(self) -> None:
        """Follow the workers in rotation that are not followed yet; stop following those that left
        rotation, and forget those the registry forgot."""
        known = {w.name for w in self.registry.workers}
        for name in [n for n in self.index.workers if n not in known]:
            self.index.forget(name)
        wanted = {w.name: w for w in self.registry.workers if w.in_rotation}
        for name in [n for n in self._following if n not in wanted]:
            self._following.pop(name).cancel()
        for name, worker in wanted.items():
            if name not in self._following or self._following[name].done():
                self._following[name] = asyncio.create_task(self._follow(worker), name=f"kv-events-{name}")

    async def _follow(self, worker: Worker) -> None:
        idx = self.index.of(worker.name)
        while True:
            try:
                if idx.stale:
                    resp = await self.http.get(f"{worker.url}/kv/blocks", timeout=5.0)
                    resp.raise_for_status()
                    idx.load(KvBlocksReply.model_validate_json(resp.content))
                await self._read(worker, idx)
                log.info("kv index of %s: events lost or server restarted; loading its blocks", worker.name)
            except (httpx.HTTPError, ValidationError) as exc:
                log.debug("kv event stream of %s: %s", worker.name, exc)
                await asyncio.sleep(self.retry_s)  # a backoff before the next try, not a wait for a state

    async def _read(self, worker: Worker, idx: WorkerKvIndex) -> None:
        """Apply the stream's pages until one does not apply (the index is then stale)."""
        timeout = httpx.Timeout(5.0, read=self.STREAM_READ_S)
        url = f"{worker.url}/kv/events/stream"
        async with self.http.stream("GET", url, params={"after": idx.seq}, timeout=timeout) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if not idx.apply(KvEventsReply.model_validate_json(line)):
                    return
                self.pages += 1
        raise httpx.ReadError("the stream ended")  # the server closed it: open it again after a pause

    async def run(self) -> None:
        """Follow the workers forever (cancel the task to stop: every stream closes with it)."""
        try:
            while True:
                self.sync()
                await asyncio.sleep(self.retry_s)
        finally:
            tasks = list(self._following.values())
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
