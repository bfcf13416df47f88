"""Worker health: passive (real calls, router/cluster/health.py) and active (router/cluster/registry.py)."""

import asyncio
import time

import httpx

from router.cluster.health import PassiveHealth
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.worker_client import WorkerFailed
from tests.waiting import until
from transfer.outcome import Outcome


def check_three_times(registry: WorkerRegistry, handler) -> None:
    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for _ in range(3):
                await registry.check_once(client)

    asyncio.run(run())


def slow(request):
    raise httpx.ReadTimeout("no answer in time")


def test_a_busy_worker_whose_health_check_times_out_stays_in_rotation_while_its_requests_speak():
    worker = Worker("d0", "decode", "http://d0")
    worker.inflight = 3  # this router has requests on it
    registry = WorkerRegistry([worker], unhealthy_after=2, stream_stall_s=15.0)
    PassiveHealth(registry).answered(worker)  # a token or a heartbeat just now
    check_three_times(registry, slow)
    assert worker.healthy and worker.failures == 0
    assert registry.healthy("decode") == [worker]


def test_a_busy_worker_silent_for_the_stall_time_whose_health_check_times_out_leaves_rotation():
    worker = Worker("d0", "decode", "http://d0")
    worker.inflight = 3  # streams open on it, and none said anything (heartbeats included) for 15 s
    registry = WorkerRegistry([worker], unhealthy_after=2, stream_stall_s=15.0)
    worker.last_seen = time.monotonic() - 15.0
    check_three_times(registry, slow)
    assert not worker.healthy and worker.failures == 3


def test_an_idle_worker_whose_health_check_times_out_leaves_rotation():
    worker = Worker("d0", "decode", "http://d0")
    registry = WorkerRegistry([worker], unhealthy_after=2)
    check_three_times(registry, slow)
    assert not worker.healthy and worker.failures == 3


def test_a_refused_health_check_counts_even_while_busy():
    def refused(request):
        raise httpx.ConnectError("connection refused")

    worker = Worker("d0", "decode", "http://d0")
    worker.inflight = 3
    registry = WorkerRegistry([worker], unhealthy_after=2)
    check_three_times(registry, refused)
    assert not worker.healthy


def test_a_worker_answering_real_calls_is_polled_all_the_same_and_its_load_is_the_reported_one():
    """Real calls show a worker alive but say nothing of its load: a prefill server that answered one just
    now is polled at once all the same, so the queued tokens the router reads (its least-loaded policy, and
    the planner through the router's metrics) are the server's now, not those of the last poll before the
    traffic began (a busy server once read 900 queued tokens through a whole phase of 48-token prompts)."""
    worker = Worker("p0", "prefill", "http://p0")
    worker.queue_depth, worker.queued_tokens, worker.free_blocks = 1, 900, 2  # its report before the traffic
    registry = WorkerRegistry([worker], health_interval_s=60.0)  # one poll in this test: the first
    PassiveHealth(registry).answered(worker)
    polls = []

    def report(request):
        polls.append(request.url.path)
        kv = {"free": 14, "reserved": 0, "running": 2, "total": 16, "block_size": 4}
        return httpx.Response(200, json={"status": "ok", "queue_depth": 0, "queued_tokens": 0, "kv_blocks": kv})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(report)) as client:
            watch = asyncio.create_task(registry.run(client))
            try:
                await until(lambda: worker.queued_tokens == 0, 5)
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(run())
    assert polls == ["/health"]
    assert (worker.queue_depth, worker.queued_tokens, worker.free_blocks) == (0, 0, 14)
    assert worker.healthy and worker.failures == 0


def test_connection_refused_on_a_real_call_takes_the_worker_out_at_once():
    worker = Worker("p0", "prefill", "http://p0")
    health = PassiveHealth(WorkerRegistry([worker]))
    health.failed(worker, WorkerFailed.of(worker, "refused", Outcome.UNREACHABLE, never_reached=True))
    assert not worker.healthy


def test_real_calls_that_time_out_take_the_worker_out_only_when_nothing_else_answers_in_between():
    worker = Worker("p0", "prefill", "http://p0")
    health = PassiveHealth(WorkerRegistry([worker]), failures_to_leave=3)
    timed_out = WorkerFailed.of(worker, "timed out", Outcome.TIMED_OUT)
    for _ in range(5):  # two timeouts, then an answer: alive
        health.failed(worker, timed_out)
        health.failed(worker, timed_out)
        health.answered(worker)
    assert worker.healthy and worker.request_failures == 0
    for _ in range(3):
        health.failed(worker, timed_out)
    assert not worker.healthy


def test_a_worker_answering_about_one_request_stays_in_rotation():
    worker = Worker("d0", "decode", "http://d0")
    health = PassiveHealth(WorkerRegistry([worker]), failures_to_leave=1)
    for outcome in (Outcome.NO_ROOM, Outcome.LEASE_EXPIRED, Outcome.CHECKSUM_MISMATCH, Outcome.ABORTED):
        health.failed(worker, WorkerFailed.of(worker, "about this request", outcome))
    assert worker.healthy and worker.request_failures == 0


def test_the_health_check_waits_the_configured_timeout_not_the_interval():
    # On a loaded machine an idle, live worker's /health took over a second: with the timeout tied to
    # a 0.5 s interval (1 s), two such checks took it out right after the router said it was ready.
    seen = []

    def record(request):
        seen.append(request.extensions["timeout"]["read"])
        return httpx.Response(200, json={"status": "ok"})

    registry = WorkerRegistry([Worker("d0", "decode", "http://d0")], health_interval_s=0.5, health_timeout_s=3.5)
    check_three_times(registry, record)
    assert seen == [3.5, 3.5, 3.5]


def test_a_decode_streams_heartbeats_are_answers_and_never_events():
    from router.cluster.worker_client import DecodeStream
    from wire.replies import AliveEvent, ReservationEvent, TokensEvent

    lines = [
        ReservationEvent(reservation=None).model_dump_json(),
        AliveEvent().model_dump_json(),
        "",
        AliveEvent().model_dump_json(),
        TokensEvent(token_ids=[7], finish_reason="length").model_dump_json(),
    ]

    async def source():
        for line in lines:
            yield line.encode()

    class Response:
        async def aiter_lines(self):  # nothing after the last event
            return
            yield

    answered = []
    worker = Worker("d0", "decode", "http://d0")
    stream = DecodeStream(worker, Response(), source(), answered.append)

    async def run():
        await stream.read_reservation()
        return [e async for e in stream.events()]

    events = asyncio.run(run())
    assert [(e.type, e.token_ids) for e in events] == [("tokens", [7])]
    assert len(answered) == 4  # the reservation, two heartbeats, the tokens


def test_a_decode_stream_s_lines_come_whole_however_its_chunks_cut_them():
    from router.cluster.worker_client import ndjson_lines

    big = b"x" * 70_000

    def cut(data: bytes, sizes: list[int]) -> list[bytes]:
        chunks, start = [], 0
        for n in sizes:
            chunks.append(data[start : start + n])
            start += n
        return chunks + ([data[start:]] if start < len(data) else [])

    data = b'{"a":1}\n{"b":2}\n\n' + big + b"\n" + b'{"c":3}'  # an empty line, a long one, no final newline
    expected = [b'{"a":1}', b'{"b":2}', b"", big, b'{"c":3}']

    async def lines(chunks: list[bytes]) -> list[bytes]:
        async def source():
            for chunk in chunks:
                yield chunk

        return [line async for line in ndjson_lines(source())]

    for sizes in ([len(data)], [1] * len(data), [3, 5, 8, 13, 21, 34, 55, 89], [20, 1000, 1000, 1000, 1000]):
        assert asyncio.run(lines(cut(data, sizes))) == expected, sizes
    assert asyncio.run(lines([b"one\n", b"two\n"])) == [b"one", b"two"]
    assert asyncio.run(lines([])) == []
