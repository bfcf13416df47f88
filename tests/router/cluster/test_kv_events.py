"""router/cluster/kv_events.py: the poller that feeds each worker's block-hash events into the
router's KvIndex. Workers answer through an httpx MockTransport from real event logs
(engine/kv_events.py), and every request it makes is recorded."""

from __future__ import annotations

import asyncio

import httpx

from engine.kv_events import KvEventLog
from router.cluster.kv_events import KvEventPoller
from router.cluster.kv_index import KvIndex
from router.cluster.registry import Worker, WorkerRegistry
from tests.support.kv_indexes import page, snapshot
from tests.waiting import until


class Workers:
    """``GET /kv/events`` and ``GET /kv/blocks`` of every worker with a log in ``logs``, by host;
    hosts in ``failing`` answer 500, and ``garbled`` ones a body that is not a reply."""

    def __init__(self, **logs: KvEventLog) -> None:
        self.logs = logs
        self.failing: set[str] = set()
        self.garbled: set[str] = set()
        self.asked: list[str] = []  # "host path?query", in order

    def handle(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        query = request.url.query.decode()
        self.asked.append(f"{host} {path}" + (f"?{query}" if query else ""))
        if host in self.failing:
            return httpx.Response(500, json={"error": "down"})
        if host in self.garbled:
            return httpx.Response(200, json={"epoch": 1})
        log = self.logs[host]
        if path == "/kv/events":
            return httpx.Response(200, content=page(log, int(request.url.params["after"])).model_dump_json())
        return httpx.Response(200, content=snapshot(log).model_dump_json())


def poller(workers: Workers, *names: str) -> tuple[KvEventPoller, KvIndex, WorkerRegistry]:
    registry = WorkerRegistry([Worker(n, "decode", f"http://{n}") for n in names])
    index = KvIndex()
    http = httpx.AsyncClient(transport=httpx.MockTransport(workers.handle))
    return KvEventPoller(registry, index, http, interval=0.01), index, registry


def test_a_new_worker_is_loaded_from_its_blocks_then_followed_by_its_events():
    log = KvEventLog(epoch="e1")
    log.stored(11)
    log.stored(22)
    workers = Workers(d0=log)
    kv, index, _ = poller(workers, "d0")

    async def run():
        await kv.poll_once()
        first = (index.of("d0").seq, set(index.of("d0").hashes))
        log.stored(33)
        log.evicted(11)
        await kv.poll_once()
        return first

    assert asyncio.run(run()) == (2, {11, 22})
    assert workers.asked == ["d0 /kv/blocks", "d0 /kv/events?after=2"]
    idx = index.of("d0")
    assert (idx.epoch, idx.seq, idx.hashes, idx.resyncs) == ("e1", 4, {22, 33}, 1)


def test_a_restarted_worker_is_loaded_again_in_the_same_poll():
    log = KvEventLog(epoch="e1")
    log.stored(11)
    workers = Workers(d0=log)
    kv, index, _ = poller(workers, "d0")

    async def run():
        await kv.poll_once()
        restarted = KvEventLog(epoch="e2")
        restarted.stored(99)
        workers.logs["d0"] = restarted
        await kv.poll_once()

    asyncio.run(run())
    assert workers.asked == ["d0 /kv/blocks", "d0 /kv/events?after=1", "d0 /kv/blocks"]
    idx = index.of("d0")
    assert (idx.epoch, idx.seq, idx.hashes, idx.resyncs) == ("e2", 1, {99}, 2)


def test_a_worker_that_does_not_answer_or_answers_garbage_keeps_its_index_as_it_was():
    log = KvEventLog(epoch="e1")
    log.stored(11)
    workers = Workers(d0=log)
    kv, index, _ = poller(workers, "d0")

    async def run():
        await kv.poll_once()
        log.stored(22)
        workers.failing.add("d0")
        await kv.poll_once()
        held_when_failing = (index.of("d0").seq, set(index.of("d0").hashes))
        workers.failing.clear()
        workers.garbled.add("d0")
        await kv.poll_once()
        return held_when_failing

    assert asyncio.run(run()) == (1, {11})
    idx = index.of("d0")
    assert (idx.epoch, idx.seq, idx.hashes) == ("e1", 1, {11})


def test_only_workers_in_rotation_are_polled_and_one_the_registry_forgot_leaves_the_index():
    workers = Workers(d0=KvEventLog(epoch="e0"), d1=KvEventLog(epoch="e1"))
    kv, index, registry = poller(workers, "d0", "d1")
    index.of("gone").load(snapshot(KvEventLog(epoch="old")))
    registry.workers[1].draining = True

    asyncio.run(kv.poll_once())
    assert workers.asked == ["d0 /kv/blocks"]
    assert sorted(index.workers) == ["d0"]


def test_run_polls_until_cancelled():
    log = KvEventLog(epoch="e1")
    workers = Workers(d0=log)
    kv, index, _ = poller(workers, "d0")

    async def run():
        task = asyncio.create_task(kv.run())
        log.stored(7)
        await until(lambda: 7 in index.of("d0").hashes, what="the poller took the block in")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task.cancelled()

    assert asyncio.run(run()) is True
