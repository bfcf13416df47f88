"""The decode server's reservation state machine, in process, with a scripted KV receiver.

Every path ends with all blocks free; a cancelled reservation stays reserved
until the receiver confirms its transfer id ended (no write can land after)."""

from __future__ import annotations

import asyncio

import pytest

from engine.request import SamplingParams
from server_common.faults import FaultInjector, FaultPlan
from tests.support.scripted import decode_engine, event_lines, generate_request, run_decode_service
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import TokensEvent, WorkerError
from wire.requests import GenerateRequest


@pytest.fixture(scope="module")
def engine(tiny_model):
    return decode_engine(tiny_model)


def blocks(service) -> tuple[int, int, int]:
    s = service.engine_thread.stats.scheduler
    return s.free, s.reserved, s.running


PER_REQUEST = ("active", "streams", "awaiting", "cancelling", "unfilled_claims", "receiver_transfers")


async def until_all_back(service) -> None:
    """Every block free, and no per-request entry left. The blocks come back on the engine thread; a
    request's entries go on the event loop when the engine's outputs reach it, a moment later."""
    keys = ("engine_requests", *PER_REQUEST)
    await until(
        lambda: blocks(service) == (8, 0, 0) and all(service.bookkeeping()[k] == 0 for k in keys),
        what="every block free and every per-request entry gone",
    )
    idle = service.bookkeeping()
    assert {k: idle[k] for k in keys} == dict.fromkeys(keys, 0)


def test_reservation_then_kv_then_tokens_until_max_tokens(engine):
    async def scenario(service, receiver):
        first, active = await service.open(generate_request("a"))
        res = first.reservation
        assert (res.transfer_id, res.block_ids, res.block_size, res.num_tokens) == ("t0", [0, 1], 4, 6)
        await until(lambda: blocks(service) == (6, 2, 0))
        receiver.end("t0", Outcome.OK, first_tokens=(42,))
        lines = await event_lines(service.events(first, active))
        assert len(lines) == 1 + 3 and '"token_ids":[42]' in lines[1] and '"finish_reason":"length"' in lines[-1]

    run_decode_service(engine, scenario)


def test_tokens_queued_while_the_client_was_away_go_out_in_one_write(engine):
    async def scenario(service, receiver):
        first, active = await service.open(generate_request("a"))
        receiver.end("t0", Outcome.OK, first_tokens=(42,))
        await until(lambda: active.queue.qsize() == 3, what="every step's tokens queued")
        writes = [chunk async for chunk in service.events(first, active)]
        assert len(writes) == 2 and writes[1].count("\n") == 3 and '"finish_reason":"length"' in writes[1]
        assert active.finished
        await until(lambda: blocks(service) == (8, 0, 0))

    run_decode_service(engine, scenario)


def test_failed_transfer_ends_the_stream_with_an_error_and_frees_the_blocks(engine):
    async def scenario(service, receiver):
        first, active = await service.open(generate_request("b"))
        receiver.end("t0", Outcome.LEASE_EXPIRED, "lease expired before the KV arrived")
        lines = await event_lines(service.events(first, active))
        assert '"code":"lease_expired"' in lines[-1]

    run_decode_service(engine, scenario)


def test_client_leaving_cancels_and_frees_only_when_the_receiver_confirms(engine):
    async def scenario(service, receiver):
        first, active = await service.open(generate_request("c"))
        await service.close("c")
        assert receiver.cancelled == ["t0"]
        # The drop ran on the engine thread (close awaited it), and the blocks are still reserved there:
        # a one-sided write may still land in them.
        now = (await service.engine_thread.run(lambda e: e.stats())).scheduler
        assert (now.free, now.reserved, now.running) == (6, 2, 0)
        receiver.end("t0", Outcome.CANCELLED, "cancelled")
        await until(lambda: blocks(service) == (8, 0, 0))
        receiver.end("t0", Outcome.OK, first_tokens=(7,))  # a late completion is ignored

    run_decode_service(engine, scenario)


def test_bookkeeping_holds_a_reservation_until_its_transfer_ended_then_nothing(engine):
    async def scenario(service, receiver):
        await service.open(generate_request("c"))
        held = service.bookkeeping()
        assert {k: held[k] for k in PER_REQUEST} == dict.fromkeys(PER_REQUEST, 1) | {"cancelling": 0}
        await service.close("c")  # the client left: cancelled, waiting for the receiver to confirm
        assert service.bookkeeping()["cancelling"] == 1
        receiver.end("t0", Outcome.CANCELLED, "cancelled")
        # The engine's stats are a copy published after its steps: waiting on them alone could pass
        # before the engine thread took the receiver's answer. Every count must reach 0, and stay there.
        await until(lambda: service.bookkeeping()["cancelling"] == 0)
        await until_all_back(service)

    run_decode_service(engine, scenario)


def test_no_room_is_refused_at_once_with_503(engine):
    async def scenario(service, receiver):
        first, active = await service.open(generate_request("d", n=27))  # 28 tokens: 7 of 8 blocks
        with pytest.raises(WorkerError) as info:
            await service.open(generate_request("e", n=6))
        assert info.value.status == 503 and info.value.retry_after == 1
        assert await service.abort("d")
        assert receiver.cancelled == ["t0"]
        receiver.end("t0", Outcome.CANCELLED, "cancelled")

    run_decode_service(engine, scenario)


def test_duplicate_request_id_is_refused(engine):
    async def scenario(service, receiver):
        await service.open(generate_request("f"))
        with pytest.raises(WorkerError) as info:
            await service.open(generate_request("f"))
        assert info.value.status == 409
        await service.close("f")
        receiver.end("t0", Outcome.CANCELLED, "cancelled")

    run_decode_service(engine, scenario)


@pytest.mark.parametrize("local", [False, True], ids=["reservation", "local_prefill"])
def test_an_open_aborted_before_it_took_its_blocks_frees_them_once_it_took_them(engine, local):
    # A router that waited longer than its stall time for this open aborts it and opens again under
    # another id; the open, held before its reservation (hold_opens), goes on only after the abort.
    async def scenario(service, receiver):
        service.faults = faults = FaultInjector()
        faults.arm(FaultPlan(hold_opens=1, pause_timeout_s=30))
        req = generate_request("slow").model_copy(update={"local_prefill": local})
        opening = asyncio.create_task(service.open(req))
        await until(lambda: faults.status().held_opens == 1, what="the open held before its reservation")
        assert await service.abort("slow")  # it is active: the abort found it
        assert service.bookkeeping()["active"] == 0 and not opening.done()
        faults.release()
        with pytest.raises(WorkerError) as info:
            await opening
        assert (info.value.status, info.value.code) == (409, Outcome.ABORTED)
        if not local:  # the reservation it made is cancelled, and freed once the receiver confirms
            assert receiver.cancelled == ["t0"]
            receiver.end("t0", Outcome.CANCELLED, "cancelled")
        await until_all_back(service)
        assert faults.status().injected["opens_held"] == 1
        first, active = await service.open(generate_request("next"))  # the hold was for one open only
        assert first.reservation is not None
        await service.close("next")
        receiver.end(first.reservation.transfer_id, Outcome.CANCELLED, "cancelled")

    run_decode_service(engine, scenario)


@pytest.mark.parametrize("local", [False, True], ids=["reservation", "local_prefill"])
def test_an_open_under_way_when_the_server_drains_with_migrate_is_refused_and_frees_what_it_took(engine, local):
    # A role switch or an admin drain with drain: migrate while an open, held before its reservation
    # (hold_opens), is still reserving: the open goes on after the drain began. It must not hand out a
    # reservation whose stream already moved off (its blocks would wait out the lease); it answers 503
    # draining, which the router answers by opening the request on another decode server.
    async def scenario(service, receiver):
        service.faults = faults = FaultInjector()
        faults.arm(FaultPlan(hold_opens=1, pause_timeout_s=30))
        req = generate_request("slow").model_copy(update={"local_prefill": local})
        opening = asyncio.create_task(service.open(req))
        await until(lambda: faults.status().held_opens == 1, what="the open held before its reservation")
        active = service._active["slow"]
        service.drain.start()
        await until(lambda: active.moved, what="the drain moved the open's stream off")
        faults.release()
        with pytest.raises(WorkerError) as info:
            await opening
        assert (info.value.status, info.value.code, info.value.retry_after) == (503, Outcome.DRAINING, 1)
        if not local:  # the reservation it made is cancelled at once, and freed once the receiver confirms
            assert receiver.cancelled == ["t0"]
            receiver.end("t0", Outcome.CANCELLED, "cancelled")
        await until_all_back(service)
        assert service.drain.inflight == 0

    metrics = run_decode_service(engine, scenario, drain="migrate")
    assert 'pdserve_transfer_failures_total{outcome="lease_expired"} 0.0' in metrics
    assert 'pdserve_requests_total{outcome="draining"} 1.0' in metrics


def test_n_sequences_stream_with_their_index_and_the_stream_ends_after_the_last_one(engine):
    async def scenario(service, receiver):
        req = GenerateRequest(
            request_id="g",
            prompt_token_ids=list(range(10, 16)),
            sampling=SamplingParams(max_tokens=3, temperature=0, n=2, logprobs=2),
        )
        first, active = await service.open(req)
        receiver.end("t0", Outcome.OK, first_tokens=(42, 43))
        events = [
            TokensEvent.model_validate_json(line) for line in (await event_lines(service.events(first, active)))[1:]
        ]
        by_index = {i: [e for e in events if e.index == i] for i in (0, 1)}
        assert len(events) == 6 and [e.token_ids for e in by_index[0]][0] == [42]
        assert [e.token_ids for e in by_index[1]][0] == [43]
        for seq in by_index.values():
            assert [e.finish_reason for e in seq] == [None, None, "length"]
            assert seq[0].logprobs is None  # the prefill server has the first token's
            assert all(len(e.logprobs) == 1 and len(e.logprobs[0].top) == 2 for e in seq[1:])
        assert events[-1].finish_reason == "length" and active.finished

    run_decode_service(engine, scenario)


@pytest.mark.parametrize("first_tokens", [(42,), (42, 43, 44), (42, 1 << 20)])
def test_a_notice_without_one_first_token_in_the_vocabulary_per_sequence_fails_the_request(engine, first_tokens):
    async def scenario(service, receiver):
        req = GenerateRequest(
            request_id="h",
            prompt_token_ids=list(range(10, 16)),
            sampling=SamplingParams(max_tokens=3, temperature=0, n=2),
        )
        first, active = await service.open(req)
        receiver.end("t0", Outcome.OK, first_tokens=first_tokens)
        lines = await event_lines(service.events(first, active))
        assert len(lines) == 2 and '"code":"bad_notice"' in lines[-1]

    run_decode_service(engine, scenario)


def test_a_continued_sequence_streams_only_its_new_tokens_and_a_bad_one_is_a_400(engine):
    prompt, sampling = list(range(10, 16)), SamplingParams(max_tokens=5, temperature=0, logprobs=1)

    async def tokens(service, rid: str, generated: list[int]) -> list[TokensEvent]:
        req = GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=sampling,
            local_prefill=True,
            generated_token_ids=generated,
        )
        first, active = await service.open(req)
        assert first.reservation is None
        lines = await event_lines(service.events(first, active))
        return [TokensEvent.model_validate_json(line) for line in lines[1:]]

    async def scenario(service, receiver):
        whole = await tokens(service, "whole", [])
        ids = [e.token_ids[0] for e in whole]
        rest = await tokens(service, "rest", ids[:2])
        assert [e.token_ids[0] for e in rest] == ids[2:]
        assert [e.logprobs[0].logprob for e in rest] == pytest.approx([e.logprobs[0].logprob for e in whole[2:]])
        assert rest[-1].finish_reason == whole[-1].finish_reason == "length"
        stops = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(ids[0],))
        bad = GenerateRequest(
            request_id="bad", prompt_token_ids=prompt, sampling=stops, local_prefill=True, generated_token_ids=ids[:2]
        )
        with pytest.raises(WorkerError) as info:
            await service.open(bad)
        assert info.value.status == 400 and "ends the sequence" in str(info.value)
        await until(lambda: blocks(service)[0] == service.engine_thread.stats.scheduler.total)

    run_decode_service(engine, scenario)


@pytest.mark.parametrize(
    "change,why",
    [
        ({"local_prefill": False}, "needs local_prefill"),
        ({"sampling": SamplingParams(max_tokens=3, n=2)}, "sampling.n must be 1"),
        ({"sampling": SamplingParams(max_tokens=1)}, "fewer than sampling.max_tokens"),
        ({"generated_token_ids": [-1]}, "greater than or equal to 0"),
        ({"generated_token_ids": [1 << 40]}, "less than"),
        ({"generated_token_ids": "12"}, "list"),
    ],
)
def test_a_hostile_continuation_is_refused_by_validation(change, why):
    fields = {
        "request_id": "x",
        "prompt_token_ids": [1, 2],
        "sampling": SamplingParams(max_tokens=3),
        "local_prefill": True,
        "generated_token_ids": [5],
        **change,
    }
    with pytest.raises(ValueError, match=why):
        GenerateRequest.model_validate(fields)
