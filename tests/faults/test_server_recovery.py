"""Decode and prefill servers facing failed transfers, in process with scripted
KV ports: what each does with the blocks, the stream and the metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import generate_latest

from decode_server.app import create_app
from decode_server.service import GenerationService
from engine import EngineConfig, LLMEngine, SamplingParams
from server_common.faults import FaultInjector
from server_common.settings import ServerSettings
from tests.support.scripted import (
    ScriptedReceiver,
    event_lines,
    generate_request,
    prefill_request,
    run_decode_service,
    run_prefill_service,
)
from tests.waiting import until
from transfer.outcome import DECIDED_BY_DECODE, Outcome
from wire.replies import WorkerError


@pytest.fixture(scope="module")
def decode_engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=8, num_threads=1, mode="decode"))


@pytest.fixture(scope="module")
def prefill_engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=16, num_threads=1, mode="prefill"))


def sample(metrics: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize(
    "code,setting", [(Outcome.LEASE_EXPIRED, "lease_expiry"), (Outcome.CHECKSUM_MISMATCH, "checksum_failure")]
)
def test_failed_remote_kv_is_prefilled_here_when_configured(decode_engine, code, setting):
    expected = decode_engine.generate([list(range(10, 16))], SamplingParams(max_tokens=3, temperature=0))[0].token_ids

    async def scenario(service, receiver):
        first, active = await service.open(generate_request("a", max_tokens=3))
        receiver.end("t0", code, "it failed")
        lines = await event_lines(service.events(first, active))
        assert '"type":"reprefill"' in lines[1] and f'"code":"{code}"' in lines[1]
        got = [t for line in lines[2:] for t in json.loads(line)["token_ids"]]
        assert got == expected  # the same greedy tokens as a plain local prefill

    metrics = run_decode_service(decode_engine, scenario, **{setting: "local"})
    assert sample(metrics, f'pdserve_reprefills_total{{outcome="{code}"}}') == 1


def test_checksum_mismatch_fails_the_request_by_default_and_is_counted(decode_engine):
    async def scenario(service, receiver):
        first, active = await service.open(generate_request("b"))
        receiver.end("t0", Outcome.CHECKSUM_MISMATCH, "checksum mismatch (sent 0x1, received 0x2)")
        lines = await event_lines(service.events(first, active))
        assert '"type":"error"' in lines[-1] and '"code":"checksum_mismatch"' in lines[-1]

    metrics = run_decode_service(decode_engine, scenario)
    assert sample(metrics, 'pdserve_transfer_failures_total{outcome="checksum_mismatch"}') == 1
    assert sample(metrics, 'pdserve_transfers_discarded_total{reason="expired"}') == 2  # the receiver's count


def test_blocks_by_age_show_a_waiting_reservation(decode_engine):
    async def scenario(service, receiver):
        await service.open(generate_request("c"))
        await asyncio.sleep(1.1)
        await until(lambda: service.engine_thread.stats.scheduler.reserved == 2)
        text = generate_latest(service.metrics.registry).decode()
        assert sample(text, 'pdserve_kv_blocks_by_age{age="1s_10s",state="reserved"}') == 2
        assert sample(text, 'pdserve_kv_oldest_block_seconds{state="reserved"}') >= 1.0
        assert service.health().kv_blocks.total == 8
        await service.close("c")
        receiver.end("t0", Outcome.CANCELLED, "cancelled")

    run_decode_service(decode_engine, scenario)


def test_a_prefill_aborted_before_it_arrived_is_refused_without_any_work(prefill_engine):
    async def scenario(service, sender):
        assert not await service.abort("late")  # the router gave up first
        with pytest.raises(WorkerError) as info:
            await service.prefill(prefill_request("late", 5))
        assert info.value.code == "aborted"
        assert not [c for c in sender.calls if c[0] == "begin"]

    run_prefill_service(prefill_engine, scenario)


@pytest.mark.parametrize(
    "code,decided", [(Outcome.REFUSED, True), (Outcome.CANCELLED, True), (Outcome.PEER_LOST, False)]
)
def test_prefill_failure_passes_the_transfer_outcome_on_unchanged(prefill_engine, code, decided):
    """The router reads from the code alone whether the decode server decided the transfer's end."""

    async def scenario(service, sender):
        task = asyncio.ensure_future(service.prefill(prefill_request("x", 5)))
        await until(lambda: any(c[0] == "finish" for c in sender.calls))
        sender.end("t-x", code, "it failed")
        with pytest.raises(WorkerError) as info:
            await task
        assert (info.value.status, info.value.code) == (502, code)
        assert (info.value.code in DECIDED_BY_DECODE) == decided

    run_prefill_service(prefill_engine, scenario)


def test_the_admin_fault_routes_exist_only_when_fault_injection_is_on(decode_engine):
    def paths(faults):
        service = GenerationService(
            ServerSettings(name="d0", role="decode", engine=decode_engine.config),
            decode_engine,
            ScriptedReceiver,
            faults,
        )
        return {route.path for route in create_app(service).routes}

    assert not any(p.startswith("/admin/faults") for p in paths(None))  # /admin/drain and /resume always exist
    assert {"/admin/faults", "/admin/faults/release"} <= paths(FaultInjector())
