"""A prefill server's read of a reservation's cached prefix on the decode server (``read_prefix``, POST
/kv/read), in process with a scripted receiver: the engine thread only pins the blocks read, their bytes are
copied out on another thread, and the pin is dropped on the engine thread afterwards on every path. Each
read's copy here waits on an event the test sets (``PinnedRead.copy`` wrapped), so the test knows the copy is
under way: meanwhile the engine keeps stepping a decoding stream, and a pinned block stays out of every free
list even once its reservation is gone. Block counts are exact before, during and after each read."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from decode_server.service import GenerationService
from engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.tiers.offered import PinnedRead, read_tokens
from kvlink.prefix_read import check_header, decode_prefix
from server_common.settings import ServerSettings
from tests.support.scripted import ScriptedReceiver, event_lines, scripted
from tests.waiting import until
from transfer.outcome import Outcome
from wire.replies import TokensEvent, WorkerError
from wire.requests import GenerateRequest, KVPrefixRead

PROMPT = list(range(10, 24))  # 14 tokens: 3 full blocks of 4 and 2 tokens
BLOCKS = 32
WAIT_S = 30.0


def generate(rid: str, prompt: list[int], max_tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


class HeldCopies:
    """``PinnedRead.copy`` that says when a copy started (``started``, counted) and waits for ``go`` first,
    then copies (or raises ``fail`` when set)."""

    def __init__(self, monkeypatch) -> None:
        self.started = 0
        self.go = threading.Event()
        self.fail: Exception | None = None
        copy = PinnedRead.copy

        def held(read: PinnedRead):
            self.started += 1
            assert self.go.wait(WAIT_S), "the test never let the copy go"
            if self.fail is not None:
                raise self.fail
            return copy(read)

        monkeypatch.setattr(PinnedRead, "copy", held)


def serve(tiny_model, scenario) -> None:
    """d0 (blocks of 4, prefix caching on) with a scripted receiver; ``scenario(service, receiver, engine)``;
    then every block free and the engine's bookkeeping intact."""
    engine = LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=BLOCKS, num_threads=1, mode="decode"))
    make_receiver, made = scripted(ScriptedReceiver)
    service = GenerationService(
        ServerSettings(name="d0", role="decode", engine=engine.config, lease_s=30.0), engine, make_receiver
    )
    (receiver,) = made

    async def main():
        await service.start()
        try:
            await scenario(service, receiver)
            await until(lambda: counts(service) == (BLOCKS, 0, 0), what="every block free")
            assert service.bookkeeping()["read_pins"] == 0
        finally:
            await service.stop()

    try:
        asyncio.run(main())
        engine.check_integrity()
    finally:
        engine.close()


def counts(service) -> tuple[int, int, int]:
    s = service.engine_thread.stats.scheduler
    return s.free, s.reserved, s.running


async def exact_counts(service) -> tuple[int, int, int]:
    """Blocks by state now, taken on the engine thread (with its bookkeeping checked there)."""

    def take(e: LLMEngine) -> tuple[int, int, int]:
        e.check_integrity()
        c = e.block_counts()
        return c["free"], c["reserved"], c["running"]

    return await service.engine_thread.run(take)


async def next_turn_reserved(service, receiver) -> str:
    """a runs and finishes (its 4 blocks cached); b shares a's first 12 tokens, reserved with them pinned
    (3 blocks) and 2 more: transfer t1, whose cached prefix is 12 tokens."""
    first, active = await service.open(generate("a", PROMPT))
    receiver.end("t0", Outcome.OK, first_tokens=(42,))
    assert len(await event_lines(service.events(first, active))) == 1 + 3
    first, _ = await service.open(generate("b", PROMPT[:12] + [300, 301, 302, 303]))
    assert (first.reservation.transfer_id, first.num_cached_tokens) == ("t1", 12)
    return "t1"


def test_the_engine_steps_while_a_reads_copy_is_under_way_and_the_read_holds_the_prefix(tiny_model, monkeypatch):
    held = HeldCopies(monkeypatch)

    async def scenario(service, receiver):
        tid = await next_turn_reserved(service, receiver)
        first, streaming = await service.open(generate("c", list(range(100, 106)), max_tokens=40))
        receiver.end(first.reservation.transfer_id, Outcome.OK, first_tokens=(7,))
        await until(lambda: streaming.queue.qsize() >= 2, what="c decoding")
        b_blocks = await service.engine_thread.run(lambda e: list(e.scheduler.parked["b"].block_ids))
        expected = await service.engine_thread.run(lambda e: read_tokens(e.cache, b_blocks, 0, 12))
        reading = asyncio.create_task(service.read_prefix(KVPrefixRead(transfer_id=tid, start=0, end=12)))
        await until(lambda: held.started == 1, what="the read's copy under way")
        assert service.bookkeeping()["read_pins"] == 1
        # The copy waits on the test, and the engine still steps: c's tokens keep coming.
        queued = streaming.queue.qsize()
        await until(lambda: streaming.queue.qsize() >= queued + 3, what="c's next tokens during the copy")
        assert not reading.done()
        held.go.set()
        headers, body = await reading
        tokens = decode_prefix(check_header(headers, len(body), tid, 0, 12), bytearray(body))
        assert tokens.shape == expected.shape and torch.equal(tokens, expected)
        await until(lambda: service.bookkeeping()["read_pins"] == 0, what="the pin dropped")
        lines = await event_lines(service.events(first, streaming))
        assert sum(len(TokensEvent.model_validate_json(x).token_ids) for x in lines[1:]) == 40
        # Only b is left: its 5 blocks reserved (3 of them a's cached ones), a's 4th cached block free.
        assert await exact_counts(service) == (BLOCKS - 5, 5, 0)
        await service.close("b")
        receiver.end(tid, Outcome.CANCELLED, "cancelled")

    serve(tiny_model, scenario)


@pytest.mark.parametrize("ending", ["cancelled", "failed"])
def test_a_read_left_or_failed_mid_copy_keeps_its_blocks_pinned_until_the_copy_ends(tiny_model, monkeypatch, ending):
    """The read's caller leaves (its task cancelled) or the copy fails, and b's reservation ends too (its
    client left), all while the copy is under way: the 3 blocks read stay held, counted reserved, out of the
    free lists, until the copy ends; then every block is back."""
    held = HeldCopies(monkeypatch)

    async def scenario(service, receiver):
        tid = await next_turn_reserved(service, receiver)
        assert await exact_counts(service) == (BLOCKS - 5, 5, 0)
        reading = asyncio.create_task(service.read_prefix(KVPrefixRead(transfer_id=tid, start=0, end=12)))
        await until(lambda: held.started == 1, what="the read's copy under way")
        assert await exact_counts(service) == (BLOCKS - 5, 5, 0)  # the pin holds blocks b holds already
        if ending == "cancelled":
            reading.cancel()
        await service.close("b")
        receiver.end(tid, Outcome.CANCELLED, "cancelled")
        await until(lambda: service.bookkeeping()["awaiting"] == 0 and service.bookkeeping()["cancelling"] == 0)
        # b's 2 blocks of its own are free again; the 3 the read copies are not.
        assert await exact_counts(service) == (BLOCKS - 3, 3, 0)
        assert service.bookkeeping()["read_pins"] == 1
        if ending == "failed":
            held.fail = RuntimeError("copy failed")
        held.go.set()
        if ending == "cancelled":
            with pytest.raises(asyncio.CancelledError):
                await reading
        else:
            with pytest.raises(RuntimeError, match="copy failed"):
                await reading
        await until(lambda: service.bookkeeping()["read_pins"] == 0, what="the pin dropped")
        assert await exact_counts(service) == (BLOCKS, 0, 0)

    serve(tiny_model, scenario)


def test_a_read_for_no_waiting_reservation_or_past_its_prefix_pins_nothing(tiny_model, monkeypatch):
    held = HeldCopies(monkeypatch)

    async def scenario(service, receiver):
        tid = await next_turn_reserved(service, receiver)
        for start, end in ((0, 13), (12, 13), (5, 4)):  # past the 12 cached tokens, or empty
            with pytest.raises(WorkerError) as info:
                await service.read_prefix(KVPrefixRead(transfer_id=tid, start=start, end=end))
            assert (info.value.status, info.value.code) == (400, Outcome.BAD_REQUEST)
        with pytest.raises(WorkerError) as info:
            await service.read_prefix(KVPrefixRead(transfer_id="t9", start=0, end=4))
        assert (info.value.status, info.value.code) == (409, Outcome.STALE_RESERVATION)
        assert held.started == 0 and service.bookkeeping()["read_pins"] == 0
        assert await exact_counts(service) == (BLOCKS - 5, 5, 0)
        await service.close("b")
        receiver.end(tid, Outcome.CANCELLED, "cancelled")

    serve(tiny_model, scenario)


def test_a_read_whose_caller_leaves_before_its_copy_started_drops_its_pin_at_once(tiny_model, monkeypatch):
    """Three reads, two copy threads: the third waits for a thread, its blocks pinned; its caller leaves, its
    copy is cancelled before it ran, and its pin goes at once while the two others still copy."""
    held = HeldCopies(monkeypatch)

    async def scenario(service, receiver):
        tid = await next_turn_reserved(service, receiver)
        read = KVPrefixRead(transfer_id=tid, start=0, end=12)
        copying = [asyncio.create_task(service.read_prefix(read)) for _ in range(2)]
        await until(lambda: held.started == 2, what="both copy threads busy")
        waiting = asyncio.create_task(service.read_prefix(read))
        await until(lambda: service.bookkeeping()["read_pins"] == 3, what="the third read pinned, queued")
        waiting.cancel()
        await until(lambda: service.bookkeeping()["read_pins"] == 2, what="the queued read's pin dropped")
        assert held.started == 2 and await exact_counts(service) == (BLOCKS - 5, 5, 0)
        held.go.set()
        answers = await asyncio.gather(*copying)
        assert len({bytes(body) for _, body in answers}) == 1 and held.started == 2
        await until(lambda: service.bookkeeping()["read_pins"] == 0, what="every pin dropped")
        await service.close("b")
        receiver.end(tid, Outcome.CANCELLED, "cancelled")

    serve(tiny_model, scenario)
