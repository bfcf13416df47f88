"""Reservation flooding: one caller may hold at most
``max_unfilled_blocks_per_caller`` blocks reserved and not yet filled; the
rest is refused like a full cache (503 no_room) and counted, other callers
are not affected, and a filled reservation frees the caller's quota."""

from __future__ import annotations

import asyncio

import pytest

from decode_server.service import GenerationService
from engine import EngineConfig, LLMEngine
from server_common.settings import ServerSettings
from tests.support.scripted import ScriptedReceiver, generate_request, scripted
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import WorkerError


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=8, num_threads=1, mode="decode"))


def test_a_caller_past_its_unfilled_blocks_gets_503_and_others_still_reserve(engine):
    make_receiver, made = scripted(ScriptedReceiver)
    service = GenerationService(
        ServerSettings(name="d0", role="decode", engine=engine.config, lease_s=5.0, max_unfilled_blocks_per_caller=3),
        engine,
        make_receiver,
    )
    (receiver,) = made

    async def main():
        await service.start()
        try:
            first, active = await service.open(generate_request("a1"), caller="10.0.0.9")  # 2 blocks
            with pytest.raises(WorkerError) as refused:
                await service.open(generate_request("a2"), caller="10.0.0.9")  # 2 more: over 3
            assert (refused.value.status, refused.value.code) == (503, "no_room")
            assert service.unfilled.refused == 1
            other, other_active = await service.open(generate_request("b1"), caller="127.0.0.1")
            receiver.end(first.reservation.transfer_id, Outcome.OK, first_tokens=(42,))  # filled: no longer counts
            await until(lambda: service.unfilled.held("10.0.0.9") == 0)
            again, again_active = await service.open(generate_request("a3"), caller="10.0.0.9")
            for rid in ("a1", "b1", "a3"):
                await service.close(rid)
            for res in (other.reservation, again.reservation):  # the receiver confirms the cancels
                receiver.end(res.transfer_id, Outcome.CANCELLED, "cancelled")
            await until(lambda: service.engine_thread.stats.scheduler.free == 8)
        finally:
            await service.stop()

    asyncio.run(main())
    engine.check_integrity()
