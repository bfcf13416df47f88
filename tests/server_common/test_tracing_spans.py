"""Server spans in process, with an in-memory exporter: what a decode and a
prefill server record for a request, a failed transfer's outcome code on its
span, and nothing at all when tracing is off."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from decode_server.service import GenerationService
from engine import EngineConfig, LLMEngine
from prefill_server.service import PrefillService
from server_common.settings import ServerSettings
from server_common.tracing import Tracing, TracingSettings
from tests.support.scripted import (
    ScriptedReceiver,
    event_lines,
    generate_request,
    prefill_request,
    scripted,
    scripted_link,
)
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import WorkerError

ROUTER_TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def decode_engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=8, num_threads=1, mode="decode"))


@pytest.fixture(scope="module")
def prefill_engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=16, num_threads=1, mode="prefill"))


def spans(exporter: InMemorySpanExporter) -> dict[str, object]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_decode_stream_whose_kv_never_arrived_carries_the_outcome_code(decode_engine):
    exporter = InMemorySpanExporter()
    make_receiver, made = scripted(ScriptedReceiver)
    service = GenerationService(
        ServerSettings(name="d0", role="decode", engine=decode_engine.config, lease_s=5.0),
        decode_engine,
        make_receiver,
        tracing=Tracing(TracingSettings(), "d", exporter),
    )

    async def main():
        await service.start()
        try:
            req = generate_request("a").model_copy(update={"trace": ROUTER_TRACE})
            first, active = await service.open(req)
            made[0].end("t0", Outcome.CHECKSUM_MISMATCH, "checksum mismatch")
            lines = await event_lines(service.events(first, active))
            assert '"code":"checksum_mismatch"' in lines[-1]
            await until(lambda: service.engine_thread.stats.scheduler.free == 8, 5, "blocks freed")
        finally:
            await service.stop()

    asyncio.run(main())
    got = spans(exporter)
    generate, kv_wait = got["decode.generate"], got["decode.kv_wait"]
    assert f"{generate.context.trace_id:032x}" == ROUTER_TRACE.split("-")[1]
    assert f"{generate.parent.span_id:016x}" == ROUTER_TRACE.split("-")[2]  # under the router's span
    assert kv_wait.parent.span_id == generate.context.span_id
    assert kv_wait.attributes["pdserve.outcome"] == "checksum_mismatch"
    assert generate.attributes["pdserve.outcome"] == "checksum_mismatch"
    assert "decode.decode" not in got  # no token was ever produced


def test_a_prefill_records_queue_compute_and_transfer_under_the_routers_span(prefill_engine):
    exporter = InMemorySpanExporter()
    make_link, made = scripted_link()
    service = PrefillService(
        ServerSettings(name="p0", role="prefill", engine=prefill_engine.config),
        prefill_engine,
        make_link,
        tracing=Tracing(TracingSettings(), "p", exporter),
    )

    async def main():
        await service.start()
        try:
            req = prefill_request("x", 9).model_copy(update={"trace": ROUTER_TRACE})
            task = asyncio.ensure_future(service.prefill(req))
            await until(lambda: any(c[0] == "finish" for c in made[0].calls), 10, "prompt prefilled")
            made[0].end("t-x", Outcome.PEER_LOST, "decode server gone")
            with pytest.raises(WorkerError):
                await task
            await until(lambda: service.engine_thread.stats.scheduler.free == 16, 5, "blocks freed")
        finally:
            await service.stop()

    asyncio.run(main())
    got = spans(exporter)
    top = got["prefill.prefill"]
    assert f"{top.parent.span_id:016x}" == ROUTER_TRACE.split("-")[2]
    for name in ("prefill.queue", "prefill.compute", "prefill.kv_transfer"):
        assert got[name].parent.span_id == top.context.span_id, name
        assert got[name].start_time <= got[name].end_time
    assert got["prefill.queue"].end_time == got["prefill.compute"].start_time
    assert got["prefill.kv_transfer"].attributes["pdserve.outcome"] == "peer_lost"
    assert top.attributes["pdserve.outcome"] == "peer_lost"
    assert top.attributes["pdserve.prompt_tokens"] == 9


def test_with_tracing_off_nothing_is_recorded_and_no_context_is_passed_on():
    off = Tracing(TracingSettings(), "off")
    assert not off.enabled
    assert off.start("x", off.parent(ROUTER_TRACE)) is None
    assert off.traceparent(None) is None
