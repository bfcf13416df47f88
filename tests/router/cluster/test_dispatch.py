"""The dispatcher and the worker registry against scripted workers (no servers)."""

import asyncio

import httpx
import pytest

from engine.request import SamplingParams, kv_blocks_needed
from router.cluster.admission import Admission, AdmissionSettings
from router.cluster.dispatch import Dispatcher, DispatchSettings
from router.cluster.policies import RoundRobin
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.worker_client import WorkerFailed
from router.errors import OpenAIError
from tests.support.fakes import FakeWorkerClient
from transfer.outcome import Outcome

SAMPLING = SamplingParams(max_tokens=4, temperature=0)


def make(fake, workers=None, admission=None, **settings):
    workers = workers or [Worker("p0", "prefill", "http://p0"), Worker("d0", "decode", "http://d0")]
    registry = WorkerRegistry(workers)
    return registry, Dispatcher(
        registry,
        RoundRobin(),
        RoundRobin(),
        fake,
        DispatchSettings(**settings),
        admission=Admission(admission or AdmissionSettings()),
    )


async def drain(session):
    try:
        return [e.token_ids for e in [x async for x in session.deltas()]]
    finally:
        await session.close()


def test_failed_prefill_ends_the_request_with_500_and_aborts_the_decode_server():
    class FailingPrefill(FakeWorkerClient):
        async def prefill(self, worker, req):
            raise WorkerFailed.of(worker, "connection reset", Outcome.UNREACHABLE)

    fake = FailingPrefill(reply=[1, 2, 3], delay=0.05)
    registry, dispatcher = make(fake, prefill_failure="fail")

    async def run():
        session = await dispatcher.start("r1", [5, 6], SAMPLING)
        with pytest.raises(OpenAIError) as info:
            await drain(session)
        return info.value

    err = asyncio.run(run())
    assert err.status == 500 and "p0" in err.message and "r1" in err.message
    assert ("d0", "r1") in fake.aborts
    assert not registry.workers[0].healthy  # taken out until a health check passes
    assert registry.workers[1].inflight == 0


def test_unreachable_decode_server_is_skipped_and_marked_down():
    class OneDown(FakeWorkerClient):
        async def open_decode(self, worker, req):
            if worker.name == "d0":
                raise WorkerFailed.of(worker, "refused", Outcome.UNREACHABLE, never_reached=True)
            return await super().open_decode(worker, req)

    workers = [Worker("p0", "prefill", "u"), Worker("d0", "decode", "u"), Worker("d1", "decode", "u")]
    fake = OneDown(reply=[7, 8])
    registry, dispatcher = make(fake, workers)

    async def run():
        return await drain(await dispatcher.start("r2", [1], SAMPLING))

    assert asyncio.run(run()) == [[7], [8]]
    assert [w.name for w in registry.healthy("decode")] == ["d1"]
    assert fake.opened[0][0] == "d1"


def test_an_open_given_up_on_is_aborted_and_the_request_opens_again_under_another_id():
    # d0's first open does not answer within stream_stall_s; the next one meets an attempt holding its id.
    tried: list[str] = []

    class SlowThenTaken(FakeWorkerClient):
        async def open_decode(self, worker, req):
            tried.append(req.request_id)
            if len(tried) == 1:
                raise WorkerFailed.of(worker, "timed out: ReadTimeout()", Outcome.TIMED_OUT)
            if len(tried) == 2:
                raise WorkerFailed.of(worker, "HTTP 409: already active", Outcome.DUPLICATE_REQUEST)
            return await super().open_decode(worker, req)

    fake = SlowThenTaken(reply=[7, 8])
    _, dispatcher = make(fake, admission=AdmissionSettings(poll=0.01))

    async def run():
        session = await dispatcher.start("r9", [1, 2, 3], SAMPLING)
        assert session.attempt_id == "r9-open2"
        tokens = await drain(session)
        await asyncio.gather(*dispatcher._aborts)
        return tokens

    assert asyncio.run(run()) == [[7], [8]]
    assert tried == ["r9", "r9-open1", "r9-open2"]
    assert fake.aborts == [("d0", "r9")]  # the open given up on; the refused one left nothing there
    assert [(name, req.request_id, req.reservation.request_id) for name, req in fake.prefills] == [
        ("p0", "r9-open2", "r9-open2")
    ]


def test_no_room_anywhere_waits_up_to_the_queue_timeout_then_429():
    fake = FakeWorkerClient(reply=[1], full={"d0"})
    _, dispatcher = make(
        fake, admission=AdmissionSettings(queue_timeout_s=0.2, poll=0.05, retry_after_s=2.0), no_room_cooldown=0.01
    )

    async def run():
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(OpenAIError) as info:
            await dispatcher.start("r3", [1], SAMPLING)
        return info.value, loop.time() - start

    err, waited = asyncio.run(run())
    assert err.status == 429 and err.retry_after == 2.0
    assert 0.2 <= waited < 1.0


def test_colocated_cluster_always_prefills_locally():
    fake = FakeWorkerClient(reply=[1])
    _, dispatcher = make(fake, [Worker("c0", "decode", "u")], local_prefill_threshold=0)
    assert dispatcher.wants_local_prefill(10_000)


def test_health_checks_take_a_worker_out_and_bring_it_back():
    state = {"up": False}

    def handler(request):
        if not state["up"]:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"kv_blocks": {"free": 7}, "queue_depth": 2, "queued_tokens": 30})

    worker = Worker("d0", "decode", "http://d0")
    registry = WorkerRegistry([worker], unhealthy_after=2)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await registry.check_once(client)
            first = worker.healthy
            await registry.check_once(client)
            second = worker.healthy
            state["up"] = True
            await registry.check_once(client)
            return first, second

    assert asyncio.run(run()) == (True, False)
    assert worker.healthy and (worker.free_blocks, worker.queue_depth, worker.queued_tokens) == (7, 2, 30)


def test_prefill_server_that_cannot_be_connected_to_is_skipped():
    class FirstPrefillDown(FakeWorkerClient):
        async def prefill(self, worker, req):
            if worker.name == "p0":
                raise WorkerFailed.of(worker, "connection refused", Outcome.UNREACHABLE, never_reached=True)
            return await super().prefill(worker, req)

    workers = [Worker("p0", "prefill", "u"), Worker("p1", "prefill", "u"), Worker("d0", "decode", "u")]
    fake = FirstPrefillDown(reply=[4, 5], delay=0.02)
    registry, dispatcher = make(fake, workers)

    async def run():
        return await drain(await dispatcher.start("r4", [1, 2], SAMPLING))

    assert asyncio.run(run()) == [[4], [5]]
    assert [name for name, _ in fake.prefills] == ["p1"]
    assert [w.name for w in registry.healthy("prefill")] == ["p1"]


def test_local_prefill_is_decided_on_the_part_the_chosen_decode_server_does_not_cache():
    """Threshold 20: a 101-token prompt whose first 96 tokens d1 caches has 5 left: d1 prefills it.
    On d0, which caches nothing, the same prompt goes to the prefill server."""
    from router.cluster.policies import CacheAware
    from tests.support.kv_indexes import index_holding

    prompt = list(range(1, 102))
    index = index_holding({"d1": 24}, prompt)  # 24 blocks of 4
    workers = [
        Worker("p0", "prefill", "http://p0"),
        Worker("d0", "decode", "http://d0"),
        Worker("d1", "decode", "http://d1"),
    ]
    registry = WorkerRegistry(workers)
    fake = FakeWorkerClient(reply=[5, 6])
    dispatcher = Dispatcher(
        registry,
        CacheAware(index),
        RoundRobin(),
        fake,
        DispatchSettings(local_prefill_threshold=20),
        admission=Admission(AdmissionSettings()),
        kv_index=index,
    )

    async def run(request_id):
        session = await dispatcher.start(request_id, prompt, SAMPLING)
        await drain(session)
        await session.close()

    asyncio.run(run("r1"))
    assert [(name, req.local_prefill) for name, req in fake.opened] == [("d1", True)]
    assert fake.prefills == [] and dispatcher.admission.prefills_pending == 0
    registry.find("d1").draining = True  # only d0 left: 101 uncached tokens
    asyncio.run(run("r2"))
    assert [(name, req.local_prefill) for name, req in fake.opened[1:]] == [("d0", False)]
    assert [name for name, _ in fake.prefills] == ["p0"] and dispatcher.admission.prefills_pending == 0


def workers_holding(p0_tokens: int, d0_tokens: int, d1_tokens: int | None = None) -> list[Worker]:
    """Workers whose health reported caches of these many tokens."""
    sizes = [("p0", "prefill", p0_tokens), ("d0", "decode", d0_tokens)]
    if d1_tokens is not None:
        sizes.append(("d1", "decode", d1_tokens))
    workers = []
    for name, role, tokens in sizes:
        w = Worker(name, role, f"http://{name}")
        w.apply_health({"kv_blocks": {"free": tokens // 16, "total": tokens // 16, "block_size": 16}})
        workers.append(w)
    return workers


def test_a_prompt_no_prefill_server_can_hold_is_prefilled_on_the_decode_server_and_never_sent_to_one():
    fake = FakeWorkerClient(reply=[1, 2])
    registry, dispatcher = make(fake, workers=workers_holding(p0_tokens=64, d0_tokens=1024))

    async def run(prompt):
        return await drain(await dispatcher.start(f"r{len(prompt)}", prompt, SAMPLING))

    assert asyncio.run(run(list(range(64)))) == [[1], [2]]  # 64 tokens and the first drawn: 65 > 64
    assert asyncio.run(run(list(range(63)))) == [[1], [2]]  # exactly 64: p0 prefills it
    assert [(name, req.local_prefill) for name, req in fake.opened] == [("d0", True), ("d0", False)]
    assert [name for name, _ in fake.prefills] == ["p0"]
    assert registry.workers[1].inflight == 0


def test_a_prompt_only_some_decode_servers_can_hold_goes_to_one_of_them_and_none_is_a_400():
    fake = FakeWorkerClient(reply=[1])
    registry, dispatcher = make(fake, workers=workers_holding(p0_tokens=4096, d0_tokens=256, d1_tokens=2048))

    async def run(rid, prompt):
        return await drain(await dispatcher.start(rid, prompt, SAMPLING))

    for i in range(3):  # round robin would alternate: only d1 holds 1000 tokens
        asyncio.run(run(f"big{i}", list(range(1000))))
    assert [name for name, _ in fake.opened] == ["d1", "d1", "d1"]
    with pytest.raises(OpenAIError) as info:
        asyncio.run(run("huge", list(range(2048))))
    assert (info.value.status, info.value.code) == (400, "context_length_exceeded")
    assert "2048 tokens" in info.value.message
    assert len(fake.opened) == 3 and all(w.inflight == 0 for w in registry.workers)


def test_a_worker_that_reports_no_cache_size_is_taken_to_hold_anything():
    worker = Worker("d0", "decode", "http://d0")
    worker.apply_health({"kv_blocks": {"free": 3, "total": 3}})  # an older server: no block size
    assert worker.capacity_tokens == 0 and worker.can_hold(10**6)


def decode_of(blocks: int, block_size: int = 16, name: str = "d0") -> Worker:
    w = Worker(name, "decode", f"http://{name}")
    w.apply_health({"kv_blocks": {"free": blocks, "total": blocks, "block_size": block_size}})
    return w


def test_a_request_over_its_share_of_the_kv_cache_is_a_400_naming_what_to_lower_or_gets_a_lower_max_tokens():
    # d0: 512 blocks of 16; one request may need 256. A 2000-token prompt (125 full blocks, shared)
    # and 16 sequences of 2000 tokens need 125 + 16 x 125 = 2125: 128 tokens each is the most.
    _, dispatcher = make(FakeWorkerClient(reply=[1]), workers=[Worker("p0", "prefill", "http://p0"), decode_of(512)])
    with pytest.raises(OpenAIError) as info:
        dispatcher.kv_budget(2000, 2000, 16, explicit=True)
    e = info.value
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "max_tokens")
    assert "the prompt's 2000 tokens and 16 sequences of up to 2000 tokens" in e.message
    assert "256 blocks of 16 tokens (0.5 of decode server d0's 512)" in e.message
    assert "lower max_tokens (at most 128 here) or n" in e.message
    assert dispatcher.kv_budget(2000, 2000, 16, explicit=False) == 128  # not set by the client: lowered
    assert dispatcher.kv_budget(2000, 128, 16, explicit=True) == 128
    assert kv_blocks_needed(2000, 128, 16, 16) <= 256 < kv_blocks_needed(2000, 129, 16, 16)
    assert dispatcher.kv_budget(4000, 96, 1, explicit=True) == 96  # 256 blocks exactly
    with pytest.raises(OpenAIError) as info:  # the prompt alone is over the share: no max_tokens helps
        dispatcher.kv_budget(4200, 10, 1, explicit=False)
    named = info.value.named("max_completion_tokens")  # as a chat request that gave that name words it
    assert (named.param, named.code) == ("max_completion_tokens", "context_length_exceeded")
    assert named.message.endswith("shorten the prompt")
    with pytest.raises(OpenAIError) as info:
        dispatcher.kv_budget(2000, 2000, 16, explicit=True)
    assert "lower max_completion_tokens (at most 128 here) or n" in info.value.named("max_completion_tokens").message


def test_the_kv_share_is_configurable_and_a_server_that_reports_no_size_limits_nothing():
    _, whole = make(
        FakeWorkerClient(reply=[1]),
        workers=[Worker("p0", "prefill", "http://p0"), decode_of(512)],
        max_request_kv_share=1.0,
    )
    # the whole cache: 125 shared blocks and 16 x 24 own ones, where half of it allowed 16 x 8
    assert whole.kv_budget(2000, 2000, 16, explicit=False) == (125 + 24) * 16 - 2000 == 384
    _, unsized = make(FakeWorkerClient(reply=[1]))  # workers that never reported a cache
    assert unsized.kv_budget(2000, 2000, 16, explicit=True) == 2000


def test_a_request_goes_only_to_a_decode_server_whose_share_holds_it():
    fake = FakeWorkerClient(reply=[1])
    registry, dispatcher = make(
        fake, workers=[Worker("p0", "prefill", "http://p0"), decode_of(64, name="d0"), decode_of(512, name="d1")]
    )
    sampling = SamplingParams(max_tokens=400, n=2, temperature=0)  # 2 x 25 blocks + none shared: > 32, <= 256

    async def run(rid):
        return await drain(await dispatcher.start(rid, [5] * 10, sampling))

    for i in range(3):
        asyncio.run(run(f"r{i}"))
    assert [name for name, _ in fake.opened] == ["d1", "d1", "d1"]
    with pytest.raises(OpenAIError) as info:
        asyncio.run(dispatcher.start("big", [5] * 10, SamplingParams(max_tokens=4000, n=2, temperature=0)))
    assert (info.value.status, info.value.code) == (400, "context_length_exceeded")
    assert len(fake.opened) == 3 and all(w.inflight == 0 for w in registry.workers)
