"""Admission control against scripted workers (no servers): per-worker in-flight
limits, the bounded waiting room and its 429s, prefill slots, draining."""

from __future__ import annotations

import asyncio

import pytest

from engine.request import SamplingParams
from router.cluster.admission import Admission, AdmissionSettings
from router.cluster.dispatch import Dispatcher, DispatchSettings
from router.cluster.policies import RoundRobin
from router.cluster.registry import Worker, WorkerRegistry
from router.errors import OpenAIError
from server_common.guard import Drain
from tests.support.fakes import FakeWorkerClient
from tests.waiting import until

SAMPLING = SamplingParams(max_tokens=2, temperature=0)


def make(workers, admission=AdmissionSettings(), drain=None, local_prefill_threshold=0):
    registry = WorkerRegistry(workers)
    fake = FakeWorkerClient(reply=[1, 2])
    dispatcher = Dispatcher(
        registry,
        RoundRobin(),
        RoundRobin(),
        fake,
        DispatchSettings(local_prefill_threshold=local_prefill_threshold),
        admission=Admission(admission),
        drain=drain,
    )
    return registry, fake, dispatcher


def one_decode(limit=1, prefill_limit=None):
    return [Worker("p0", "prefill", "u", max_inflight=prefill_limit), Worker("d0", "decode", "u", max_inflight=limit)]


async def finish(session) -> None:
    async for _ in session.deltas():
        pass
    await session.close()


def test_a_full_waiting_room_is_a_429_at_once_with_retry_after():
    room = AdmissionSettings(max_queued_requests=1, queue_timeout_s=5, retry_after_s=3)
    _, fake, dispatcher = make(one_decode(limit=1), room)

    async def run():
        first = await dispatcher.start("r1", [1], SAMPLING)
        waiter = asyncio.create_task(dispatcher.start("r2", [1], SAMPLING))
        await until(lambda: dispatcher.admission.waiting == 1, 5.0, "r2 in the waiting room")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(OpenAIError) as info:
            await dispatcher.start("r3", [1], SAMPLING)
        refused_after = loop.time() - started
        await finish(first)
        await finish(await waiter)
        return info.value, refused_after

    err, refused_after = asyncio.run(run())
    assert (err.status, err.code, err.retry_after) == (429, "overloaded", 3)
    assert refused_after < 0.05
    assert [name for name, _ in fake.opened] == ["d0", "d0"]  # r1, then r2 once r1 freed the slot
    assert dispatcher.admission.refused == 1 and dispatcher.admission.waiting == 0


def test_a_waiter_gets_the_slot_a_finished_request_frees_without_polling():
    workers = one_decode(limit=1)
    _, fake, dispatcher = make(workers, AdmissionSettings(poll=60))

    async def run():
        first = await dispatcher.start("r1", [1], SAMPLING)
        waiter = asyncio.create_task(dispatcher.start("r2", [1], SAMPLING))
        await until(lambda: dispatcher.admission.waiting == 1, 5.0, "r2 in the waiting room")
        assert not waiter.done() and workers[1].inflight == 1
        await finish(first)
        second = await asyncio.wait_for(waiter, 1.0)  # woken by the freed slot, not by the 60 s poll
        await finish(second)

    asyncio.run(run())
    assert workers[1].inflight == 0 and dispatcher.admission.sessions == 0


def test_waiting_longer_than_the_timeout_is_a_429():
    _, _, dispatcher = make(one_decode(limit=1), AdmissionSettings(queue_timeout_s=0.1, poll=0.02))

    async def run():
        first = await dispatcher.start("r1", [1], SAMPLING)
        with pytest.raises(OpenAIError) as info:
            await dispatcher.start("r2", [1], SAMPLING)
        await finish(first)
        return info.value

    err = asyncio.run(run())
    assert err.status == 429 and "0.1 s" in err.message


def test_a_prefill_slot_frees_when_the_prefill_ends_not_when_the_request_does():
    workers = [Worker("p0", "prefill", "u", max_inflight=1), Worker("d0", "decode", "u", max_inflight=8)]
    _, fake, dispatcher = make(workers, AdmissionSettings(poll=60), local_prefill_threshold=3)

    async def run():
        first = await dispatcher.start("r1", [1, 2, 3], SAMPLING)  # needs the prefill server
        local = await dispatcher.start("r2", [1], SAMPLING)  # prefilled on d0: no prefill slot needed
        waiter = asyncio.create_task(dispatcher.start("r3", [1, 2, 3], SAMPLING))
        await until(lambda: dispatcher.admission.waiting == 1, 5.0, "r3 in the waiting room")
        assert not waiter.done() and dispatcher.admission.prefills_pending == 1
        deltas = first.deltas()
        await anext(deltas)  # r1's prefill ran; its decode goes on
        third = await asyncio.wait_for(waiter, 1.0)
        async for _ in deltas:
            pass
        await first.close()
        await finish(local)
        await finish(third)

    asyncio.run(run())
    assert [req.request_id for _, req in fake.prefills] == ["r1", "r3"]
    assert dispatcher.admission.prefills_pending == 0 and dispatcher.admission.sessions == 0


def test_draining_workers_get_no_new_requests_and_none_left_is_503():
    workers = [Worker("p0", "prefill", "u"), Worker("d0", "decode", "u"), Worker("d1", "decode", "u")]
    registry, fake, dispatcher = make(workers)
    workers[1].draining = True  # drained through the router's admin endpoint
    workers[2].apply_health({"status": "draining", "kv_blocks": {"free": 1}})  # drains itself

    async def run():
        with pytest.raises(OpenAIError) as info:
            await dispatcher.start("r1", [1], SAMPLING)
        workers[2].apply_health({"status": "ok", "kv_blocks": {"free": 1}})
        await finish(await dispatcher.start("r2", [1], SAMPLING))
        return info.value

    err = asyncio.run(run())
    assert err.status == 503 and err.message == "no healthy decode server"
    assert [name for name, _ in fake.opened] == ["d1"]
    assert [w.name for w in registry.healthy("decode")] == ["d1"]


def test_a_draining_router_refuses_new_requests_with_503():
    drain = Drain(lambda: 0)
    _, fake, dispatcher = make(one_decode(), drain=drain)
    drain.start()
    with pytest.raises(OpenAIError) as info:
        asyncio.run(dispatcher.start("r1", [1], SAMPLING))
    assert (info.value.status, info.value.code) == (503, "draining") and fake.opened == []
