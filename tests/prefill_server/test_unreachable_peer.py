"""A decode server that advertises an address nobody can reach: the prefill
server's handshake fails at once with a clear error and a metric (never a
hang), its blocks are freed, and the next request to a reachable peer works."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from engine import EngineConfig, LLMEngine
from kvlink.factory import prefill_link_factory
from prefill_server.service import PrefillService
from server_common.settings import ServerSettings
from tests.support.cluster import free_ports
from tests.support.scripted import prefill_request
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import WorkerError


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=16, num_threads=1, mode="prefill"))


def test_an_unreachable_decode_address_fails_the_prefill_at_once_with_handshake_failed(engine):
    closed = free_ports(1)[0]  # nothing listens there
    settings = ServerSettings(
        name="p0",
        role="prefill",
        engine=engine.config,
        transfer_timeout_s=30.0,
        decode_peers=(("d0", f"http://127.0.0.1:{closed}"),),
    )
    service = PrefillService(settings, engine, prefill_link_factory(settings, engine))

    async def main() -> WorkerError:
        await service.start()
        try:
            with pytest.raises(WorkerError) as info:
                # Far below the 30 s handshake timeout: a refused connection is an answer, not a wait.
                await asyncio.wait_for(service.prefill(prefill_request("r1", 9)), timeout=10)
            await until(lambda: service.engine_thread.stats.scheduler.free == 16, 5, "no block held")
            return info.value
        finally:
            await service.stop()

    error = asyncio.run(main())
    assert (error.status, error.code) == (502, Outcome.HANDSHAKE_FAILED)
    assert "cannot connect to decode server d0" in error.message
    metrics = generate_latest(service.metrics.registry).decode()
    assert 'pdserve_requests_total{outcome="handshake_failed"} 1.0' in metrics
    engine.check_integrity()
