"""The prefill server's job lifecycle, in process, with a scripted KV sender:
every layer of every chunk is pushed (a sliding-window layer only from where the
decode server's first query reads), blocks are held until the sender reports
the transfer ended, and aborts free everything."""

from __future__ import annotations

import asyncio
import threading

import pytest

import prefill_server.service
from engine import EngineConfig, LLMEngine
from engine.make_model import TINY_SWA, make_tiny
from engine.request import SamplingParams
from tests.support.scripted import prefill_request, run_prefill_service
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import WorkerError


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(
        EngineConfig(
            model=tiny_model,
            block_size=4,
            num_blocks=16,
            num_threads=1,
            mode="prefill",
            max_num_batched_tokens=8,
            prefix_caching=False,
        )
    )


def test_chunked_prompt_pushes_every_layer_and_holds_blocks_until_the_transfer_ended(engine):
    async def scenario(service, sender):
        task = asyncio.ensure_future(service.prefill(prefill_request("a", 13)))
        await until(lambda: any(c[0] == "finish" for c in sender.calls))
        pushes = [c[2:] for c in sender.calls if c[0] == "push"]  # (layer, start, end)
        assert pushes == [(0, 0, 8), (1, 0, 8), (0, 8, 13), (1, 8, 13)]  # 2 layers, chunks of 8 tokens
        assert service.engine_thread.stats.scheduler.reserved == 4  # 13 tokens in blocks of 4, held for the transfer
        assert not task.done()
        await asyncio.sleep(0.2)  # the KV still travelling after the prompt was computed
        sender.end("t-a", Outcome.OK)
        result = await task
        assert (result.num_tokens, result.first_token_ids) == (13, sender.calls[-1][2])
        assert result.transfer_bytes == 13 * engine.cache.bytes_per_token
        sample = service.metrics.registry.get_sample_value
        assert sample("pdserve_transfer_exposed_seconds_count") == 1
        exposed = sample("pdserve_transfer_exposed_seconds_sum")
        assert 0.2 <= exposed < sample("pdserve_transfer_seconds_sum") == pytest.approx(result.seconds)

    run_prefill_service(engine, scenario)


def test_failed_transfer_answers_502_and_releases_the_blocks(engine):
    async def scenario(service, sender):
        task = asyncio.ensure_future(service.prefill(prefill_request("b", 5)))
        await until(lambda: any(c[0] == "finish" for c in sender.calls))
        sender.end("t-b", Outcome.REFUSED, "checksum mismatch")
        with pytest.raises(WorkerError) as info:
            await task
        assert info.value.status == 502 and "checksum mismatch" in info.value.message

    run_prefill_service(engine, scenario)


def test_abort_stops_the_job_and_tells_the_sender(engine):
    async def scenario(service, sender):
        task = asyncio.ensure_future(service.prefill(prefill_request("c", 5)))
        await until(lambda: any(c[0] == "begin" for c in sender.calls))
        assert await service.abort("c")
        with pytest.raises(WorkerError) as info:
            await task
        assert info.value.code == "aborted"
        assert ("abort", "t-c") in sender.calls
        sender.end("t-c", Outcome.ABORTED, "aborted")  # late report: nothing left to do
        assert not await service.abort("c")

    run_prefill_service(engine, scenario)


def test_bookkeeping_is_empty_once_every_job_ended(engine):
    async def scenario(service, sender):
        tasks = [asyncio.ensure_future(service.prefill(prefill_request(rid, 5))) for rid in ("e", "f")]
        await until(lambda: sum(c[0] == "finish" for c in sender.calls) == 2)
        busy = service.bookkeeping()
        assert (busy["jobs"], busy["transfers"], busy["pending"], busy["sender_transfers"]) == (2, 2, 2, 2)
        sender.end("t-e", Outcome.OK)
        sender.end("t-f", Outcome.REFUSED, "checksum mismatch")
        await asyncio.gather(*tasks, return_exceptions=True)
        await until(lambda: service.bookkeeping()["engine_requests"] == 0)
        idle = service.bookkeeping()
        assert {k: idle[k] for k in ("jobs", "transfers", "pending", "sender_transfers", "aborted_remembered")} == {
            "jobs": 0,
            "transfers": 0,
            "pending": 0,
            "sender_transfers": 0,
            "aborted_remembered": 0,
        }
        assert idle["timeline_entries"] == 2

    run_prefill_service(engine, scenario)


def test_prompts_waiting_for_the_engine_thread_count_as_queued_until_computed(engine):
    """Prompts that reach the server while the engine thread is busy (a step, here a held call) are in
    the queue /health and /metrics report (what the router and the planner read), each prompt token
    once; a refused one leaves it when refused, computed ones when computed."""

    async def scenario(service, sender):
        assert not await service.abort("gone")  # its /prefill comes after: refused by the engine thread
        held = threading.Event()
        service.engine_thread.call(lambda e: held.wait())
        try:
            sizes = {"q1": 5, "q2": 7, "q3": 9, "gone": 6}
            tasks = [asyncio.ensure_future(service.prefill(prefill_request(rid, n))) for rid, n in sizes.items()]
            await until(lambda: service.health().queue_depth == 4, 5)
            assert (service.health().queued_tokens, service.health().num_requests) == (27, 4)
            assert service.metrics.registry.get_sample_value("pdserve_queued_tokens") == 27
            assert service.metrics.registry.get_sample_value("pdserve_waiting_requests") == 4
            assert service.engine_thread.stats.scheduler.num_requests == 0  # none reached the engine yet
        finally:
            held.set()
        with pytest.raises(WorkerError) as info:
            await tasks[-1]
        assert info.value.code == Outcome.ABORTED
        await until(lambda: sum(c[0] == "finish" for c in sender.calls) == 3)
        await until(lambda: service.health().queued_tokens == 0)
        assert service.health().queue_depth == 0
        assert service.metrics.registry.get_sample_value("pdserve_queued_tokens") == 0
        for rid in ("q1", "q2", "q3"):
            sender.end(f"t-{rid}", Outcome.OK)
        assert [(await t).num_tokens for t in tasks[:3]] == [5, 7, 9]

    run_prefill_service(engine, scenario)


def test_aborted_request_ids_are_remembered_up_to_the_bound(engine, monkeypatch):
    monkeypatch.setattr(prefill_server.service, "REMEMBER_ABORTED", 4)

    async def scenario(service, sender):
        for i in range(6):  # aborts of requests whose /prefill has not come (the router's client left)
            assert not await service.abort(f"gone-{i}")
        assert service.bookkeeping()["aborted_remembered"] == 4
        with pytest.raises(WorkerError) as info:  # among the 4 newest: refused
            await service.prefill(prefill_request("gone-5", 5))
        assert info.value.code == Outcome.ABORTED
        task = asyncio.ensure_future(service.prefill(prefill_request("gone-0", 5)))  # forgotten: computed
        await until(lambda: ("finish", "t-gone-0") in [c[:2] for c in sender.calls])
        sender.end("t-gone-0", Outcome.OK)
        assert (await task).num_tokens == 5

    run_prefill_service(engine, scenario)


def test_expired_reservation_is_refused_before_any_work(engine):
    async def scenario(service, sender):
        req = prefill_request("d", 5)
        # A nanosecond left: gone by the time the server has met the decode server.
        stale = req.model_copy(update={"reservation": req.reservation.model_copy(update={"lease_s": 1e-9})})
        with pytest.raises(WorkerError) as info:
            await service.prefill(stale)
        assert info.value.code == "lease_expired" and sender.calls == []

    run_prefill_service(engine, scenario)


def test_the_result_has_every_sequence_s_first_token_with_its_logprob_and_the_prompt_s(engine):
    async def scenario(service, sender):
        req = prefill_request("lp", 9)
        req = req.model_copy(
            update={"sampling": SamplingParams(max_tokens=4, temperature=0, n=3, logprobs=2, prompt_logprobs=1)}
        )
        task = asyncio.ensure_future(service.prefill(req))
        await until(lambda: any(c[0] == "finish" for c in sender.calls))
        sender.end("t-lp", Outcome.OK)
        result = await task
        (finish,) = [c for c in sender.calls if c[0] == "finish"]
        assert result.first_token_ids == finish[2] and len(finish[2]) == 3
        assert len(result.first_logprobs) == 3 and all(len(lp.top) == 2 for lp in result.first_logprobs)
        assert [lp.top[0][0] for lp in result.first_logprobs] == result.first_token_ids  # greedy: the top one
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == 9
        assert all(len(lp.top) == 1 for lp in result.prompt_logprobs[1:])

    run_prefill_service(engine, scenario)


@pytest.fixture(scope="module")
def swa_engine(tmp_path_factory):
    """tiny-swa in prefill mode: layers 0, 1 and 3 slide over 8 tokens, layer 2 is global."""
    model = make_tiny(tmp_path_factory.mktemp("tiny-swa"), TINY_SWA)
    config = EngineConfig(
        model=str(model), block_size=4, num_blocks=16, num_threads=1, mode="prefill", max_num_batched_tokens=8
    )
    return LLMEngine(config)


def test_window_layers_push_only_the_tokens_the_decode_server_s_first_query_reads(swa_engine):
    async def scenario(service, sender):
        task = asyncio.ensure_future(service.prefill(prefill_request("w", 13)))
        await until(lambda: any(c[0] == "finish" for c in sender.calls))
        pushes = [c[2:] for c in sender.calls if c[0] == "push"]  # (layer, start, end)
        # The first decode query (at 13) reads keys 6..13 in a window of 8; the global layer 2 reads all.
        assert pushes == [(0, 6, 8), (1, 6, 8), (2, 0, 8), (3, 6, 8), (0, 8, 13), (1, 8, 13), (2, 8, 13), (3, 8, 13)]
        sender.end("t-w", Outcome.OK)
        result = await task
        per_layer_token = swa_engine.cache.bytes_per_token // 4
        assert result.transfer_bytes == (3 * 7 + 13) * per_layer_token
        assert service.metrics.registry.get_sample_value("pdserve_transfer_bytes_total") == result.transfer_bytes

    run_prefill_service(swa_engine, scenario)
