"""The router's recovery rules and the dispatcher acting on them, with scripted
workers (no servers): what starts over, where, how often, and what fails at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from engine.request import SamplingParams
from router.cluster.dispatch import Dispatcher, DispatchSettings
from router.cluster.policies import RoundRobin
from router.cluster.recovery import decide
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.worker_client import WorkerFailed
from router.errors import OpenAIError
from tests.support.fakes import FakeStream, FakeWorkerClient
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import ReprefillEvent

SAMPLING = SamplingParams(max_tokens=3, temperature=0)
PREFILL_DOWN = WorkerFailed("prefill", "p0", "unreachable", Outcome.UNREACHABLE)


@pytest.mark.parametrize(
    "mode,other,action",
    [("retry", True, "retry"), ("retry", False, "local"), ("local", True, "local"), ("fail", True, "fail")],
)
def test_a_prefill_failure_before_the_first_token_follows_the_configured_mode(mode, other, action):
    assert decide(mode, PREFILL_DOWN, tokens_sent=False, attempts=1, other_prefill=other).action == action


def test_no_second_retry_no_retry_after_tokens_and_never_after_a_decode_failure():
    assert decide("retry", PREFILL_DOWN, tokens_sent=False, attempts=2, other_prefill=True).action == "fail"
    assert decide("retry", PREFILL_DOWN, tokens_sent=True, attempts=1, other_prefill=True).action == "fail"
    decode_down = WorkerFailed("decode", "d0", "stream broken", Outcome.UNREACHABLE)
    assert decide("local", decode_down, tokens_sent=False, attempts=1, other_prefill=True).action == "fail"


@pytest.mark.parametrize(
    "outcome,stage",
    [
        (Outcome.LEASE_EXPIRED, "prefill"),
        (Outcome.CHECKSUM_MISMATCH, "prefill"),
        (Outcome.OUT_OF_BOUNDS, "prefill"),
        (Outcome.STREAM_CUT, "decode"),
        (Outcome.ABORTED, "decode"),
    ],
)
def test_a_decode_stream_error_is_a_prefill_failure_exactly_when_the_kv_never_arrived(outcome, stage):
    assert WorkerFailed("decode", "d0", "it failed", outcome).stage == stage


def workers(num_prefill: int = 2, num_decode: int = 1) -> list[Worker]:
    return [Worker(f"p{i}", "prefill", f"http://p{i}") for i in range(num_prefill)] + [
        Worker(f"d{i}", "decode", f"http://d{i}") for i in range(num_decode)
    ]


def make(fake, ws, mode: str):
    registry = WorkerRegistry(ws)
    return registry, Dispatcher(registry, RoundRobin(), RoundRobin(), fake, DispatchSettings(prefill_failure=mode))


async def tokens(dispatcher, rid: str = "r1") -> list[int]:
    session = await dispatcher.start(rid, [5, 6, 7], SAMPLING)
    try:
        return [t for e in [x async for x in session.deltas()] for t in e.token_ids]
    finally:
        await session.close()


class PrefillFails(FakeWorkerClient):
    """Prefill servers named in ``failing`` fail after taking the request."""

    def __init__(self, failing: set[str], outcome: Outcome = Outcome.PEER_LOST, **kw) -> None:
        super().__init__(**kw)
        self.failing, self.outcome = failing, outcome

    async def prefill(self, worker, req):
        if worker.name in self.failing:
            self.prefills.append((worker.name, req))
            raise WorkerFailed.of(worker, "it failed", self.outcome)
        return await super().prefill(worker, req)


def test_prefill_failure_starts_over_once_on_the_other_prefill_server_under_a_new_id():
    fake = PrefillFails({"p0"}, Outcome.UNREACHABLE, reply=[1, 2, 3], delay=0.02)
    registry, dispatcher = make(fake, workers(), "retry")
    assert asyncio.run(tokens(dispatcher)) == [1, 2, 3]
    assert [(name, req.request_id) for name, req in fake.prefills] == [("p0", "r1"), ("p1", "r1-retry1")]
    assert [req.local_prefill for _, req in fake.opened] == [False, False]
    assert ("d0", "r1") in fake.aborts and ("p0", "r1") in fake.aborts  # the first attempt is freed
    assert [w.name for w in registry.healthy("prefill")] == ["p1"]
    assert dispatcher.recovery.retries.labels(action="retry", outcome="unreachable")._value.get() == 1
    assert all(w.inflight == 0 for w in registry.workers)


def test_prefill_failure_with_no_other_prefill_server_is_prefilled_on_the_decode_server():
    fake = PrefillFails({"p0"}, reply=[4, 5], delay=0.02)
    _, dispatcher = make(fake, workers(num_prefill=1), "retry")
    assert asyncio.run(tokens(dispatcher)) == [4, 5]
    assert [(req.request_id, req.local_prefill) for _, req in fake.opened] == [("r1", False), ("r1-retry1", True)]


def test_prefill_failure_in_fail_mode_is_a_500_naming_server_and_request():
    fake = PrefillFails({"p0"}, reply=[4, 5], delay=0.05)
    _, dispatcher = make(fake, workers(), "fail")
    with pytest.raises(OpenAIError) as info:
        asyncio.run(tokens(dispatcher, "r9"))
    assert info.value.status == 500 and "p0" in info.value.message and "r9" in info.value.message
    assert ("d0", "r9") in fake.aborts


def test_a_second_failure_is_not_retried_again():
    fake = PrefillFails({"p0", "p1"}, reply=[4, 5], delay=0.05)
    _, dispatcher = make(fake, workers(), "retry")
    with pytest.raises(OpenAIError, match="gave up after 2 attempts"):
        asyncio.run(tokens(dispatcher))
    assert [req.request_id for _, req in fake.prefills] == ["r1", "r1-retry1"]


def test_when_the_decode_server_decided_the_prefill_failure_is_left_to_its_stream():
    fake = PrefillFails({"p0"}, Outcome.CANCELLED, reply=[7, 8], delay=0.05)
    _, dispatcher = make(fake, workers(), "retry")
    assert asyncio.run(tokens(dispatcher)) == [7, 8]
    assert len(fake.opened) == 1  # no new attempt: the decode stream carried on


class DecodeSays(FakeWorkerClient):
    """The first decode stream sends ``first`` (an event or an exception) before its tokens."""

    def __init__(self, first, **kw) -> None:
        super().__init__(**kw)
        self.first = first

    async def open_decode(self, worker, req):
        stream = await super().open_decode(worker, req)
        if len(self.opened) == 1:
            return Scripted(stream, self.first, prefill_started=lambda: bool(self.prefills))
        return stream


class Scripted(FakeStream):
    """Sends ``first`` once the prefill server has the request, as a decode server that hears of it then."""

    def __init__(self, stream: FakeStream, first, prefill_started: Callable[[], bool]) -> None:
        super().__init__(stream.worker, stream.reservation, stream.events_to_send, stream.delay)
        self.first = first
        self.prefill_started = prefill_started

    async def events(self):
        await until(self.prefill_started, 5.0, "the prefill call started")
        if isinstance(self.first, BaseException):
            raise self.first
        yield self.first
        async for event in super().events():
            yield event


class SlowPrefill(FakeWorkerClient):
    async def prefill(self, worker, req):
        self.prefills.append((worker.name, req))
        await asyncio.sleep(10)


def test_a_lease_expiry_reported_by_the_decode_server_starts_over():
    d0 = Worker("d0", "decode", "u")
    fake = DecodeSays(WorkerFailed.of(d0, "lease expired before the KV arrived", Outcome.LEASE_EXPIRED), reply=[3, 1])
    _, dispatcher = make(fake, workers(), "retry")
    assert asyncio.run(tokens(dispatcher)) == [3, 1]
    assert [req.request_id for _, req in fake.opened] == ["r1", "r1-retry1"]
    assert [name for name, _ in fake.prefills] == ["p0", "p1"]


def test_a_reprefill_event_abandons_the_prefill_server_and_the_tokens_follow():
    class Both(DecodeSays, SlowPrefill):
        pass

    fake = Both(ReprefillEvent(message="lease expired; prefilling locally", code=Outcome.LEASE_EXPIRED), reply=[9, 9])
    _, dispatcher = make(fake, workers(), "fail")
    assert asyncio.run(tokens(dispatcher)) == [9, 9]
    assert fake.aborts == [("p0", "r1")]  # P told to drop it; D finished normally
    assert dispatcher.recovery.reprefills.labels(outcome="lease_expired")._value.get() == 1


def test_a_decode_failure_fails_at_once_and_tells_the_prefill_server_to_drop_it():
    class Both(DecodeSays, SlowPrefill):
        pass

    d0 = Worker("d0", "decode", "u")
    fake = Both(WorkerFailed.of(d0, "unreachable: stream broken: connection reset", Outcome.UNREACHABLE), reply=[1])
    registry, dispatcher = make(fake, workers(), "retry")

    async def run():
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(OpenAIError) as info:
            await tokens(dispatcher)
        return info.value, loop.time() - started

    err, seconds = asyncio.run(run())
    assert err.status == 500 and err.code == "unreachable" and "d0" in err.message
    assert seconds < 1.0  # not after the prefill server's 10 s
    assert ("p0", "r1") in fake.aborts and len(fake.opened) == 1
    assert not registry.workers[2].healthy


def test_no_healthy_prefill_server_prefills_locally_unless_recovery_is_fail():
    ws = workers(num_prefill=1)
    ws[0].healthy = False
    _, dispatcher = make(FakeWorkerClient(reply=[1]), ws, "retry")
    assert dispatcher.wants_local_prefill(100)
    _, strict = make(FakeWorkerClient(reply=[1]), ws, "fail")
    assert not strict.wants_local_prefill(100)


def test_health_checks_back_off_while_a_worker_is_down():
    registry = WorkerRegistry(workers(1, 0), health_interval_s=0.5, health_backoff_max_s=3.0)
    w = registry.workers[0]
    delays = []
    for failures in range(6):
        w.failures = failures
        delays.append(registry.next_check_in(w))
    assert delays == [0.5, 0.5, 1.0, 2.0, 3.0, 3.0]
    w.failures = 100_000  # a worker down for days
    assert registry.next_check_in(w) == 3.0


def test_the_health_watch_takes_a_dead_worker_out_and_brings_it_back_after_a_restart():
    up = [True]
    failed_at: list[float] = []  # when each check that found the worker down was made

    def handler(request):
        if not up[0]:
            failed_at.append(time.monotonic())
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"kv_blocks": {"free": 3}})

    registry = WorkerRegistry(workers(0, 1), health_interval_s=0.02, health_backoff_max_s=0.08)
    d0 = registry.workers[0]

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            watch = asyncio.create_task(registry.run(client))
            up[0] = False
            await until(lambda: len(failed_at) >= 6, 5.0, "six checks of the dead worker")
            down = not d0.healthy
            up[0] = True
            await until(lambda: d0.healthy, 5.0, "the worker back in rotation")
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            return down

    assert asyncio.run(run())
    assert d0.healthy and d0.free_blocks == 3
    # Backed off: the waits between checks double from the interval up to backoff_max (never shorter).
    gaps = [round(b - a, 3) for a, b in zip(failed_at[:6], failed_at[1:6])]
    assert all(gap >= least - 0.001 for gap, least in zip(gaps, [0.02, 0.04, 0.08, 0.08, 0.08], strict=True)), gaps


class Breaks(FakeWorkerClient):
    """A decode stream opened on a server in ``dying`` sends its first ``after`` events, then breaks as
    a killed server's does; a continued sequence (``generated_token_ids``) gets the rest of ``reply``."""

    def __init__(self, dying: set[str], after: int, outcome: Outcome = Outcome.UNREACHABLE, **kw) -> None:
        super().__init__(**kw)
        self.dying, self.after, self.outcome = dying, after, outcome

    def sequence(self, req, index):
        events = super().sequence(req, index)
        return events[len(req.generated_token_ids) :]

    async def open_decode(self, worker, req):
        stream = await super().open_decode(worker, req)
        if worker.name not in self.dying:
            return stream
        return Breaking(stream, self.after, WorkerFailed.of(worker, "stream broken: reset", self.outcome))


class Breaking(FakeStream):
    def __init__(self, stream: FakeStream, after: int, failure: WorkerFailed) -> None:
        super().__init__(stream.worker, stream.reservation, stream.events_to_send, stream.delay)
        self.after, self.failure = after, failure

    async def events(self):
        for event in self.events_to_send[: self.after]:
            yield event
        raise self.failure


def run_session(dispatcher, sampling: SamplingParams, rid: str = "r1"):
    async def go():
        session = await dispatcher.start(rid, [5, 6, 7], sampling)
        try:
            return [x async for x in session.deltas()], session.migrations
        finally:
            await session.close()

    return asyncio.run(go())


@pytest.mark.parametrize("after", [0, 1, 3, 4])
def test_a_broken_decode_stream_moves_to_another_decode_server_with_the_tokens_already_sent(after):
    fake = Breaks({"d0"}, after, reply=[11, 12, 13, 14, 15])
    registry, dispatcher = make(fake, workers(num_prefill=1, num_decode=2), "retry")
    sampling = SamplingParams(max_tokens=5, temperature=0.7, seed=3)
    events, migrations = run_session(dispatcher, sampling)
    assert [t for e in events for t in e.token_ids] == [11, 12, 13, 14, 15]  # none missing, none twice
    assert [e.finish_reason for e in events][-1] == "stop" and migrations == 1
    (_, first), (second_on, second) = fake.opened
    assert second_on == "d1" and second.request_id == "r1-migrate1" and second.sampling == sampling
    assert second.generated_token_ids == [11, 12, 13, 14][:after]
    assert second.local_prefill == (after > 0)  # nothing sent yet: it opens again as a new request would
    assert ("d0", "r1") in fake.aborts and not registry.workers[1].healthy
    assert dispatcher.recovery.migrations.labels(cause="unreachable")._value.get() == 1
    assert all(w.inflight == 0 for w in registry.workers)


def test_each_unfinished_sequence_of_n_continues_from_its_own_tokens_seeded_seed_plus_i():
    fake = Breaks({"d0"}, 5, reply=[21, 22, 23])  # sequence 0 sent all 3 (done), sequence 1 two
    _, dispatcher = make(fake, workers(num_prefill=1, num_decode=2), "retry")
    sampling = SamplingParams(max_tokens=3, temperature=1.0, seed=40, n=3)
    events, _ = run_session(dispatcher, sampling)
    by_index = {i: [t for e in events if e.index == i for t in e.token_ids] for i in range(3)}
    assert by_index == {0: [21, 22, 23], 1: [21, 22, 23], 2: [21, 22, 23]}
    continued = {req.request_id: req for name, req in fake.opened if name == "d1"}
    assert sorted(continued) == ["r1-migrate1-1", "r1-migrate1-2"]
    assert continued["r1-migrate1-1"].generated_token_ids == [21, 22]
    assert continued["r1-migrate1-2"].generated_token_ids == []
    assert [(r.sampling.seed, r.sampling.n) for r in continued.values()] == [(41, 1), (42, 1)]


def test_past_the_migration_limit_or_with_no_decode_server_left_the_client_gets_the_decode_error():
    fake = Breaks({"d0", "d1", "d2"}, 1, reply=[1, 2, 3, 4, 5])
    registry, dispatcher = make(fake, workers(num_prefill=1, num_decode=3), "retry")
    with pytest.raises(OpenAIError) as info:
        run_session(dispatcher, SamplingParams(max_tokens=5, temperature=0))
    assert info.value.status == 500 and "recovery.migration_limit (2) reached" in info.value.message
    assert [req.generated_token_ids for _, req in fake.opened] == [[], [1], [1, 2]]
    assert all(w.inflight == 0 for w in registry.workers)

    fake = Breaks({"d0"}, 2, reply=[1, 2, 3])
    registry, dispatcher = make(fake, workers(num_prefill=1, num_decode=1), "retry")
    with pytest.raises(OpenAIError) as info:
        run_session(dispatcher, SamplingParams(max_tokens=3, temperature=0), "r7")
    err = info.value
    assert err.status == 500 and err.code == "unreachable" and "d0" in err.message and "r7" in err.message
    assert "no other decode server could continue it" in err.message
    assert all(w.inflight == 0 for w in registry.workers)


def test_an_error_the_decode_server_sends_about_the_request_itself_is_not_migrated():
    fake = Breaks({"d0"}, 1, Outcome.BAD_REQUEST, reply=[1, 2, 3])
    _, dispatcher = make(fake, workers(num_prefill=1, num_decode=2), "retry")
    with pytest.raises(OpenAIError):
        run_session(dispatcher, SamplingParams(max_tokens=3, temperature=0))
    assert len(fake.opened) == 1


def test_a_decode_server_drained_with_migrate_hands_its_streams_to_another_at_once():
    fake = Breaks(set(), 0, reply=[31, 32, 33, 34, 35, 36], delay=0.05)
    registry, dispatcher = make(fake, workers(num_prefill=1, num_decode=2), "retry")

    async def go():
        session = await dispatcher.start("r1", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0))
        try:
            events = []
            async for event in session.deltas():
                events.append(event)
                if len(events) == 2:
                    assert dispatcher.move_off(session.decode.name) == 1
                    assert dispatcher.move_off("p0") == 0  # not a decode server
            return events, session
        finally:
            await session.close()

    events, session = asyncio.run(go())
    assert [t for e in events for t in e.token_ids] == [31, 32, 33, 34, 35, 36]
    first, second = fake.opened
    assert first[0] != second[0] and second[1].generated_token_ids == [31, 32]
    assert (first[0], "r1") in fake.aborts and session.migrations == 1
    assert dispatcher.recovery.migrations.labels(cause="draining")._value.get() == 1
    assert all(w.inflight == 0 for w in registry.workers) and not dispatcher._sessions.live
