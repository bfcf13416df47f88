"""Prefix caching in the decode and prefill services, in process, with scripted KV ports:
the reservation pins D's cached prefix and says so, P sends only what D lacks,
and D prefills a prompt itself when only its last token is missing."""

from __future__ import annotations

import asyncio

import pytest

from decode_server.service import GenerationService
from engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from prefill_server.service import PrefillService
from server_common.settings import ServerSettings
from tests.support.scripted import ScriptedReceiver, event_lines, scripted, scripted_link
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import Reservation, WorkerError
from wire.requests import GenerateRequest, PrefillRequest

PROMPT = list(range(10, 24))  # 14 tokens: 3 full blocks of 4


def generate(rid: str, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=3, temperature=0)
    )


def test_decode_reservation_pins_the_cached_prefix_and_an_almost_whole_hit_is_prefilled_here(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=16, num_threads=1, mode="decode"))
    make_receiver, made = scripted(ScriptedReceiver)
    service = GenerationService(
        ServerSettings(name="d0", role="decode", engine=engine.config, lease_s=5.0), engine, make_receiver
    )
    (receiver,) = made

    async def main():
        await service.start()
        try:
            first, active = await service.open(generate("a", PROMPT))
            assert (first.num_cached_tokens, first.reservation.block_ids, receiver.writable_from["t0"]) == (
                0,
                [0, 1, 2, 3],
                0,
            )
            receiver.end("t0", Outcome.OK, first_tokens=(42,))
            assert len(await event_lines(service.events(first, active))) == 1 + 3
            # b shares a's first 12 tokens: 3 blocks pinned, only the 2 others are written
            first, active = await service.open(generate("b", PROMPT[:12] + [300, 301, 302, 303]))
            res = first.reservation
            assert (first.num_cached_tokens, res.num_cached_tokens, res.block_ids[:3]) == (12, 12, [0, 1, 2])
            assert (len(res.block_ids), receiver.writable_from["t1"]) == (5, 3)
            stats = lambda: service.engine_thread.stats.scheduler  # noqa: E731
            # a finished: its 4th block (16 computed tokens: full) stays cached, unowned
            await until(lambda: (stats().reserved, stats().cached, stats().free) == (5, 1, 11))
            await service.close("b")
            receiver.end("t1", Outcome.CANCELLED, "cancelled")
            # c lacks only its last token: no reservation, no prefill server
            first, active = await service.open(generate("c", PROMPT[:12] + [77]))
            assert (first.reservation, first.num_cached_tokens, len(receiver.expected)) == (None, 12, 2)
            assert len(await event_lines(service.events(first, active))) == 1 + 3
            await until(lambda: service.engine_thread.stats.scheduler.free == 16)
            counters = service.engine_thread.stats.counters
            assert (counters.prefix_queries_tokens, counters.prefix_hits_tokens) == (14 + 16 + 13, 24)
        finally:
            await service.stop()

    asyncio.run(main())
    engine.check_integrity()


def prefill_request(rid: str, cached: int) -> PrefillRequest:
    res = Reservation(
        instance="d0",
        request_id=rid,
        transfer_id=f"t-{rid}",
        block_ids=[3, 4, 5, 6],
        block_size=4,
        num_tokens=len(PROMPT),
        lease_s=30,
        kv_target={"peer": "d0"},
        num_cached_tokens=cached,
    )
    return PrefillRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=4, temperature=0), reservation=res
    )


def test_prefill_sends_only_what_the_decode_server_lacks_and_reuses_its_own_cache(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=16, num_threads=1, mode="prefill"))
    make_link, made = scripted_link()
    service = PrefillService(ServerSettings(name="p0", role="prefill", engine=engine.config), engine, make_link)
    (sender,) = made
    per_token = engine.cache.bytes_per_token

    async def prefill(rid: str, cached: int):
        task = asyncio.ensure_future(service.prefill(prefill_request(rid, cached)))
        await until(lambda: ("finish", f"t-{rid}") in [c[:2] for c in sender.calls])
        pushes = [c[2:] for c in sender.calls if c[0] == "push" and c[1] == f"t-{rid}"]  # (layer, start, end)
        sender.end(f"t-{rid}", Outcome.OK)
        return pushes, await task

    async def main():
        await service.start()
        try:
            pushes, result = await prefill("a", cached=8)
            assert pushes == [(0, 8, 14), (1, 8, 14)]
            assert result.transfer_bytes == 6 * per_token
            # P holds a's first 12 tokens itself: it computes 2, still sends all D lacks
            pushes, result = await prefill("b", cached=0)
            assert pushes == [(0, 0, 14), (1, 0, 14)]
            assert result.transfer_bytes == 14 * per_token
            with pytest.raises(WorkerError) as info:
                await service.prefill(prefill_request("c", cached=14))
            assert (info.value.status, info.value.code) == (400, Outcome.BAD_REQUEST)
            await until(lambda: service.engine_thread.stats.scheduler.free == 16)
            c = service.engine_thread.stats.counters
            assert (c.prompt_tokens, c.prefix_hits_tokens) == (14 + 2, 12)
        finally:
            await service.stop()

    asyncio.run(main())
    engine.check_integrity()


def test_a_request_for_prompt_log_probabilities_reports_no_cached_tokens_and_takes_none(tiny_model):
    # Its whole prompt is computed (every row is scored), so nothing is reused: the decode server
    # reserves every block, reports 0 cached tokens (usage.prompt_tokens_details.cached_tokens) and
    # counts no prefix lookup, even with the prompt's prefix cached.
    engine = LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=16, num_threads=1, mode="decode"))
    make_receiver, made = scripted(ScriptedReceiver)
    service = GenerationService(
        ServerSettings(name="d0", role="decode", engine=engine.config, lease_s=5.0), engine, make_receiver
    )
    (receiver,) = made
    scored = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1)

    async def main():
        await service.start()
        try:
            first, active = await service.open(generate("a", PROMPT))
            receiver.end("t0", Outcome.OK, first_tokens=(42,))
            assert len(await event_lines(service.events(first, active))) == 1 + 3
            counters = service.engine_thread.stats.counters
            before = (counters.prefix_queries_tokens, counters.prefix_hits_tokens)
            for rid, prompt in (("b", PROMPT), ("c", PROMPT[:12] + [77])):  # a whole hit, and all but the last token
                first, active = await service.open(
                    GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=scored)
                )
                assert (first.num_cached_tokens, first.reservation.num_cached_tokens) == (0, 0)
                tid = first.reservation.transfer_id
                assert receiver.writable_from[tid] == 0
                receiver.end(tid, Outcome.OK, first_tokens=(42,))
                assert len(await event_lines(service.events(first, active))) == 1 + 3
            counters = service.engine_thread.stats.counters
            assert (counters.prefix_queries_tokens, counters.prefix_hits_tokens) == before
            await until(lambda: service.engine_thread.stats.scheduler.free == 16)
        finally:
            await service.stop()

    asyncio.run(main())
    engine.check_integrity()


def test_a_colocated_request_for_prompt_log_probabilities_reports_no_cached_tokens(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=16, num_threads=1, mode="colocated"))
    service = GenerationService(ServerSettings(name="c0", role="colocated", engine=engine.config), engine, None)

    async def main():
        await service.start()
        try:
            got = []
            for rid, sampling in (
                ("a", None),
                ("b", SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1)),
                ("c", None),
            ):
                req = (
                    generate(rid, PROMPT)
                    if sampling is None
                    else GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling)
                )
                first, active = await service.open(req)
                assert len(await event_lines(service.events(first, active))) == 1 + 3
                got.append(first.num_cached_tokens)
            assert got == [0, 0, 12]  # b computed its whole prompt; c reused a's 3 full blocks
            counters = service.engine_thread.stats.counters
            assert counters.prefix_hits_tokens == 12
            await until(lambda: service.engine_thread.stats.scheduler.free == 16)
        finally:
            await service.stop()

    asyncio.run(main())
    engine.check_integrity()
