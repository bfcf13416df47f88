"""Polling every worker's block-hash events into the router's ``KvIndex`` (router/cluster/kv_index.py).

Every ``interval`` seconds each worker in rotation is asked ``GET /kv/events?after=SEQ``
(an internal route: the client carries the cluster's secret); a page the index refuses
(new epoch, or events lost) is followed at once by ``GET /kv/blocks``. A worker that does
not answer keeps its index as it was: it is out of rotation or will be, and when it comes
back restarted its epoch tells. A worker the registry forgot is dropped from the index.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from pydantic import ValidationError

from router.cluster.kv_index import KvIndex
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
