"""router/cluster/session.py: one admitted request's trip, a Session built by hand (no dispatcher).

Its decode streams are scripted (events, then a failure or a wait until closed), its prefill calls
and aborts go to ``tests.support.fakes.FakeWorkerClient``, and a new attempt's stream comes from an
``open_stream`` that records what it was asked for. Each test ends with the admission books
balanced: no decode slot held, no prefill slot pending, no session open."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from prometheus_client import CollectorRegistry

from engine.request import SamplingParams
from router.cluster.admission import Admission, AdmissionSettings
from router.cluster.health import PassiveHealth
from router.cluster.policies import RoundRobin
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.session import Session, SessionContext
from router.cluster.worker_client import WorkerFailed
from router.metrics import RecoveryMetrics
from tests.support.fakes import FakeWorkerClient, fake_logprob, fake_prompt_logprobs
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import Reservation, TokensEvent

PROMPT = [5, 6, 7]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def tokens(*ids: int, index: int = 0, finish: str | None = None) -> TokensEvent:
    return TokensEvent(token_ids=list(ids), index=index, finish_reason=finish)


def reservation(worker: str = "d0", request_id: str = "r1") -> Reservation:
    return Reservation(
        instance=worker,
        request_id=request_id,
        transfer_id=f"t-{request_id}",
        block_ids=[0],
        block_size=16,
        num_tokens=len(PROMPT),
        lease_s=30.0,
        kv_target={"peer": worker},
    )


@dataclass
class Stream:
    """A decode stream: ``script``'s events in order, then ``failure`` raised, or (``hold``) no
    more until it is closed."""

    worker: Worker
    reservation: Reservation | None
    script: list[TokensEvent]
    failure: WorkerFailed | None = None
    hold: bool = False
    num_cached_tokens: int = 0
    sent: int = 0
    request_id: str = ""  # the attempt id it was opened under (open_stream's)
    closed: bool = False

    async def events(self):
        for event in self.script:
            self.sent += 1
            yield event
        if self.failure is not None:
            raise self.failure
        if self.hold:
            await asyncio.Event().wait()  # until the session cancels its pump

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class Cluster:
    """Workers p0, d0, d1, the admission books and a session context over them."""

    client: FakeWorkerClient
    next_streams: dict[str, Stream] = field(default_factory=dict)  # attempt id -> the stream open_stream gives
    opened: list[tuple] = field(default_factory=list)  # open_stream's arguments, in order

    def __post_init__(self) -> None:
        self.p0 = Worker("p0", "prefill", "http://p0")
        self.d0 = Worker("d0", "decode", "http://d0")
        self.d1 = Worker("d1", "decode", "http://d1")
        self.registry = WorkerRegistry([self.p0, self.d0, self.d1])
        self.admission = Admission(AdmissionSettings())
        self.metrics = CollectorRegistry()
        self.ctx = SessionContext(
            client=self.client,
            registry=self.registry,
            health=PassiveHealth(self.registry),
            prefill_policy=RoundRobin(),
            admission=self.admission,
            recovery=RecoveryMetrics(self.metrics),
            prefill_failure="retry",
            open_stream=self._open_stream,
        )

    async def _open_stream(self, attempt_id, prompt, sampling, local, trace, generated, avoid):
        # ``generated`` as it was asked for: the session goes on appending to its own list
        self.opened.append((attempt_id, prompt, sampling, local, trace, list(generated), avoid))
        stream = self.next_streams.pop(attempt_id)
        stream.request_id = attempt_id
        return stream, self.admission.claim(stream.worker, prefill_slot=False)

    def session(self, stream: Stream, sampling: SamplingParams = GREEDY) -> Session:
        slot = self.admission.claim(stream.worker, prefill_slot=stream.reservation is not None)
        return Session(self.ctx, "r1", PROMPT, sampling, stream, slot)

    def balanced(self) -> bool:
        a = self.admission
        inflight = [w.inflight for w in self.registry.workers]
        return inflight == [0, 0, 0] and a.prefills_pending == 0 and a.sessions == 0 and not self.ctx.live

    def count(self, name: str, **labels: str) -> float | None:
        return self.metrics.get_sample_value(name, labels)


async def drain(session: Session) -> list[TokensEvent]:
    try:
        return [event async for event in session.deltas()]
    finally:
        await session.close()


def test_a_remote_prefill_gets_the_reservation_and_a_finished_request_aborts_nothing():
    cluster = Cluster(FakeWorkerClient(reply=[1, 2]))
    stream = Stream(cluster.d0, reservation(), [tokens(1), tokens(2, finish="stop")])

    async def run():
        session = cluster.session(stream)
        assert cluster.admission.sessions == 1 and cluster.ctx.live == {session}
        return session, await drain(session)

    session, events = asyncio.run(run())
    assert events == [tokens(1), tokens(2, finish="stop")]
    [(worker, req)] = cluster.client.prefills
    assert (worker, req.request_id, req.prompt_token_ids) == ("p0", "r1", PROMPT)
    # the reservation as the decode server made it, its lease less the time the router held it
    assert req.reservation.model_copy(update={"lease_s": 30.0}) == reservation()
    assert 25.0 < req.reservation.lease_s <= 30.0
    assert session.prefill is cluster.p0 and session.decode is cluster.d0
    assert cluster.client.aborts == [] and stream.closed
    assert cluster.balanced()


def test_asked_for_log_probabilities_the_first_event_waits_for_the_prefill_result_and_carries_them():
    sampling = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1)
    stream = Stream(
        None,
        reservation(),
        [tokens(1), TokensEvent(token_ids=[2], logprobs=[fake_logprob(1, 2)], finish_reason="stop")],
    )

    class LatePrefill(FakeWorkerClient):
        async def prefill(self, worker, req):
            await until(lambda: stream.sent == 2, what="the decode server sent every event first")
            return await super().prefill(worker, req)

    cluster = Cluster(LatePrefill(reply=[1, 2]))
    stream.worker = cluster.d0
    events = asyncio.run(drain(cluster.session(stream, sampling)))
    assert [e.token_ids for e in events] == [[1], [2]]
    assert events[0].logprobs == [fake_logprob(0, 2)]  # the prefill server's score of the first token
    assert events[0].prompt_logprobs == fake_prompt_logprobs(len(PROMPT), 1)
    assert events[1].logprobs == [fake_logprob(1, 2)] and events[1].prompt_logprobs is None
    assert cluster.balanced()


def test_closing_an_unfinished_request_aborts_it_on_both_servers_once():
    cluster = Cluster(FakeWorkerClient(reply=[1]))
    stream = Stream(cluster.d0, reservation(), [tokens(1)], hold=True)

    async def run():
        session = cluster.session(stream)
        deltas = session.deltas()
        first = await deltas.__anext__()
        await until(lambda: session.prefill_result is not None, what="the prefill server answered")
        await deltas.aclose()
        await session.close()
        await session.close()  # idempotent: nothing is aborted or released twice
        return first

    assert asyncio.run(run()) == tokens(1)
    assert cluster.client.aborts == [("d0", "r1"), ("p0", "r1")]
    assert stream.closed
    assert cluster.balanced()


@dataclass
class SlowClose(Stream):
    """A stream whose close waits for ``go`` (a connection slow to shut), saying when it started."""

    closing: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)

    async def aclose(self) -> None:
        self.closing.set()
        await self.go.wait()
        self.closed = True


def test_a_close_whose_caller_is_cancelled_midway_still_aborts_and_releases_everything_once():
    """A client gone while its request's close awaits the stream: the close goes on to its end."""
    cluster = Cluster(FakeWorkerClient(reply=[1]))

    async def run():
        stream = SlowClose(cluster.d0, reservation(), [tokens(1)], hold=True)
        session = cluster.session(stream)
        deltas = session.deltas()
        await deltas.__anext__()
        await until(lambda: session.prefill_result is not None, what="the prefill server answered")
        await deltas.aclose()
        closing = asyncio.ensure_future(session.close())
        await stream.closing.wait()
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        assert closing.cancelled() and not cluster.client.aborts  # the release waits for the stream
        stream.go.set()
        await until(lambda: cluster.balanced(), what="the session released")
        await session.close()  # nothing aborted or released twice
        return stream

    stream = asyncio.run(run())
    assert cluster.client.aborts == [("d0", "r1"), ("p0", "r1")]
    assert stream.closed and cluster.balanced()


def test_move_off_migrates_only_a_session_streaming_from_that_server_with_the_tokens_sent():
    cluster = Cluster(FakeWorkerClient(reply=[]))
    stream = Stream(cluster.d0, None, [tokens(7)], hold=True)  # prefilled on the decode server: no prefill slot
    cluster.next_streams["r1-migrate1"] = Stream(cluster.d1, None, [tokens(8, finish="stop")])

    async def run():
        session = cluster.session(stream)
        deltas = session.deltas()
        first = await deltas.__anext__()
        assert session.move_off(cluster.d1) is False  # it streams from d0
        assert session.move_off(cluster.d0) is True
        rest = [event async for event in deltas]
        await session.close()
        assert session.move_off(cluster.d1) is False  # closed
        return session, [first, *rest]

    session, events = asyncio.run(run())
    assert events == [tokens(7), tokens(8, finish="stop")]
    assert cluster.opened == [("r1-migrate1", PROMPT, GREEDY, True, None, [7], frozenset({"d0"}))]
    assert (session.migrations, session.attempt_id, session.decode) == (1, "r1-migrate1", cluster.d1)
    assert cluster.client.aborts == [("d0", "r1")]  # the old attempt, where it ran
    assert cluster.count("pdserve_router_migrations_total", cause="draining") == 1.0
    assert cluster.balanced()


def test_a_request_of_n_sequences_continues_each_unfinished_one_from_its_own_tokens_renumbered():
    sampling = SamplingParams(max_tokens=4, temperature=0.7, seed=5, n=3)
    cut = WorkerFailed("decode", "d0", "connection reset", Outcome.UNREACHABLE)
    cluster = Cluster(FakeWorkerClient(reply=[]))
    stream = Stream(
        cluster.d0,
        None,
        [tokens(1, index=0), tokens(2, index=1), tokens(3, index=2, finish="stop"), tokens(4, index=1)],
        failure=cut,
    )
    cluster.next_streams["r1-migrate1-0"] = Stream(cluster.d1, None, [tokens(10, finish="stop")])
    cluster.next_streams["r1-migrate1-1"] = Stream(cluster.d1, None, [tokens(20, finish="length")])

    events = asyncio.run(drain(cluster.session(stream, sampling)))
    by_sequence = {i: [t for e in events if e.index == i for t in e.token_ids] for i in range(3)}
    assert by_sequence == {0: [1, 10], 1: [2, 4, 20], 2: [3]}
    assert sorted((e.index, e.finish_reason) for e in events if e.finish_reason) == [
        (0, "stop"),
        (1, "length"),
        (2, "stop"),
    ]
    one = replace(sampling, n=1)
    assert cluster.opened == [
        ("r1-migrate1-0", PROMPT, one, True, None, [1], frozenset({"d0"})),
        ("r1-migrate1-1", PROMPT, replace(one, seed=6), True, None, [2, 4], frozenset({"d0"})),
    ]
    assert cluster.client.aborts == [("d0", "r1")]
    assert cluster.count("pdserve_router_migrations_total", cause="unreachable") == 1.0
    assert cluster.balanced()
