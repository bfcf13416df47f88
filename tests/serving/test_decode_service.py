"""The decode server's reservation state machine, in process, with a scripted KV receiver.

Every path ends with all blocks free; a cancelled reservation stays reserved
until the receiver confirms its transfer id ended (no write can land after)."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode_server.service import DecodeService, Refused
from engine import EngineConfig, LLMEngine
from server_common.settings import ServerSettings
from server_common.worker_requests import GenerateRequest, SamplingSpec


class ScriptedReceiver:
    def __init__(self) -> None:
        self.expected: dict[str, list[int]] = {}
        self.cancelled: list[str] = []

    def start(self, on_ended) -> None:
        self.on_ended = on_ended

    def expect(self, block_ids, lease_s) -> str:
        tid = f"t{len(self.expected)}"
        self.expected[tid] = list(block_ids)
        return tid

    def target(self) -> dict:
        return {"peer": "d0", "hello_url": "http://d0/kv/hello"}

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)

    def counters(self) -> dict[str, int]:
        return {"dropped_expired": 2}

    def problem(self, stuck_after_s: float) -> str | None:
        return None

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=8, num_threads=1, mode="decode"))


def request(rid: str, n: int = 6, max_tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=list(range(10, 10 + n)),
                           sampling=SamplingSpec(max_tokens=max_tokens, temperature=0))


async def wait_for(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def run(engine, scenario):
    receiver = ScriptedReceiver()
    service = DecodeService(ServerSettings(name="d0", role="decode", engine=engine.config, lease_s=5.0),
                            engine, receiver)

    async def main():
        await service.start()
        try:
            await scenario(service, receiver)
            await wait_for(lambda: service.engine.snapshot.free == 8)
        finally:
            await service.stop()

    asyncio.run(main())
    engine.check_integrity()


def blocks(service) -> tuple[int, int, int]:
    s = service.engine.snapshot
    return s.free, s.reserved, s.running


def test_reservation_then_kv_then_tokens_until_max_tokens(engine):
    async def scenario(service, receiver):
        first, active = await service.open(request("a"))
        res = first.reservation
        assert (res.transfer_id, res.block_ids, res.block_size, res.num_tokens) == ("t0", [0, 1], 4, 6)
        await wait_for(lambda: blocks(service) == (6, 2, 0))
        receiver.on_ended("t0", 42, None)
        lines = [line async for line in service.events(first, active)]
        assert len(lines) == 1 + 3 and '"token_ids":[42]' in lines[1] and '"finish_reason":"length"' in lines[-1]

    run(engine, scenario)


def test_failed_transfer_ends_the_stream_with_an_error_and_frees_the_blocks(engine):
    async def scenario(service, receiver):
        first, active = await service.open(request("b"))
        receiver.on_ended("t0", None, "lease expired before the KV arrived")
        lines = [line async for line in service.events(first, active)]
        assert '"code":"lease_expired"' in lines[-1]

    run(engine, scenario)


def test_client_leaving_cancels_and_frees_only_when_the_receiver_confirms(engine):
    async def scenario(service, receiver):
        first, active = await service.open(request("c"))
        await service.close("c")
        assert receiver.cancelled == ["t0"]
        await asyncio.sleep(0.1)
        assert blocks(service) == (6, 2, 0)  # a one-sided write may still land
        receiver.on_ended("t0", None, "cancelled")
        await wait_for(lambda: blocks(service) == (8, 0, 0))
        receiver.on_ended("t0", 7, None)  # a late completion is ignored

    run(engine, scenario)


def test_no_room_is_refused_at_once_with_503(engine):
    async def scenario(service, receiver):
        first, active = await service.open(request("d", n=27))  # 28 tokens: 7 of 8 blocks
        with pytest.raises(Refused) as info:
            await service.open(request("e", n=6))
        assert info.value.status == 503 and info.value.retry_after == 1
        assert await service.abort("d")
        assert receiver.cancelled == ["t0"]
        receiver.on_ended("t0", None, "cancelled")

    run(engine, scenario)


def test_duplicate_request_id_is_refused(engine):
    async def scenario(service, receiver):
        await service.open(request("f"))
        with pytest.raises(Refused) as info:
            await service.open(request("f"))
        assert info.value.status == 409
        await service.close("f")
        receiver.on_ended("t0", None, "cancelled")

    run(engine, scenario)
