"""Decode-to-prefill reuse in the engine (engine/tiers/offered.py): a decode engine's reservation for a
conversation's next turn pins the earlier turn's blocks (the answer's included); a prefill engine with
an empty cache reads that prefix from it (``read_reserved``), is offered it in blocks of its own size and
order (``offer_prefix``), computes only the new tokens, and the decode engine's greedy tokens equal
transformers' (float32). P and D have different block sizes (4 and 16) and orders (NHD, HND), as in
configs/tiny-1p1d.yaml. Every scenario ends with every block free on both engines."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, NoCapacityError, SamplingParams
from engine.kv_events import KvEventLog
from tests.engine.oracle import hf_greedy

SAMPLING = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TURN1 = [(17 * i + 3) % 400 + 20 for i in range(40)]
NEW = [(11 * i + 7) % 300 + 30 for i in range(10)]


def engines(path: str) -> tuple[LLMEngine, LLMEngine]:
    prefill = LLMEngine(EngineConfig(model=path, block_size=4, num_blocks=40, num_threads=1, mode="prefill"))
    decode = LLMEngine(
        EngineConfig(model=path, block_size=16, num_blocks=12, num_threads=1, mode="decode", kv_layout="HND")
    )
    return prefill, decode


def write_remote(src: LLMEngine, src_blocks, dst: LLMEngine, dst_blocks, start: int, end: int) -> None:
    """Tokens [start, end) of a prompt's K/V from a prefill engine (NHD) into a decode engine's blocks (HND)."""
    sb, db = src.cache.block_size, dst.cache.block_size
    for p in range(start, end):
        dst.cache.kv[:, :, dst_blocks[p // db], :, p % db] = src.cache.kv[:, :, src_blocks[p // sb], p % sb]


def prefill_remote(prefill: LLMEngine, decode: LLMEngine, rid: str, tokens: list[int], pull: bool) -> list[int]:
    """One request through both engines: D reserves; P (reading D's pinned prefix first when ``pull``)
    prefills; the tokens past D's prefix are copied over; D decodes. D's tokens."""
    blocks = decode.reserve(rid, tokens, SAMPLING)
    held = decode.num_cached_tokens(rid)
    if pull and held:
        offered = prefill.offer_prefix(rid, tokens, 0, decode.read_reserved(rid, 0, held))
        assert offered == held == 47  # 11 blocks of 4 offered and a kept tail of 3
    prefill.add_request(rid, tokens, SAMPLING)
    outs: list = []
    while not outs:
        outs = prefill.step()
    (out,) = outs
    prefill.withdraw_prefix(rid)
    write_remote(prefill, out.block_ids, decode, blocks, held, len(tokens))
    prefill.release(rid)
    (first,) = decode.admit_remote(rid, out.new_token_ids)
    produced = list(first.new_token_ids)
    while decode.has_unfinished():
        produced += [t for o in decode.step() for t in o.new_token_ids]
    return produced


def all_free(*engines: LLMEngine) -> None:
    for engine in engines:
        engine.check_integrity()
        assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}


@pytest.mark.parametrize("pull", [True, False])
def test_the_next_turn_is_prefilled_from_the_decode_engines_blocks_and_stays_exact(tiny_model, pull):
    prefill, decode = engines(tiny_model)
    other = LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=40, num_threads=1, mode="prefill"))
    try:
        answer = prefill_remote(prefill, decode, "t1", TURN1, pull=False)
        assert answer == hf_greedy(tiny_model, TURN1, 8, ignore_eos=True)
        # 58 tokens: D holds 47 of them, 2 blocks of 16 and a kept tail of 15 (the answer's last token has no K/V)
        turn2 = TURN1 + answer + NEW
        before = other.stats().counters
        assert prefill_remote(other, decode, "t2", turn2, pull) == hf_greedy(tiny_model, turn2, 8, ignore_eos=True)
        after = other.stats().counters
        computed = after.prompt_tokens - before.prompt_tokens
        assert computed == (len(turn2) - 47 if pull else len(turn2))
        assert after.prefix_hits_tokens - before.prefix_hits_tokens == (47 if pull else 0)
        assert len(other.offered) == 0 and other.scheduler.tiers is None
        all_free(prefill, decode, other)
    finally:
        for engine in (prefill, decode, other):
            engine.close()


def test_a_read_is_refused_outside_a_waiting_reservations_cached_prefix(tiny_model):
    prefill, decode = engines(tiny_model)
    try:
        with pytest.raises(KeyError):
            decode.read_reserved("nobody", 0, 16)
        decode.reserve("r", TURN1, SAMPLING)  # nothing cached: no prefix to read
        with pytest.raises(ValueError):
            decode.read_reserved("r", 0, 16)
        decode.abort("r")
        with pytest.raises(ValueError):  # a range not starting on one of P's blocks
            prefill.offer_prefix("x", TURN1, 2, torch.zeros(2, 2, 16, 2, 16))
        with pytest.raises(ValueError):  # another cache's shape
            prefill.offer_prefix("x", TURN1, 0, torch.zeros(2, 2, 16, 3, 16))
        assert prefill.offer_prefix("x", TURN1[:4], 0, torch.zeros(2, 2, 4, 2, 16)) == 0  # its last token's block
        assert len(prefill.offered) == 0 and prefill.scheduler.tiers is None
        all_free(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_the_block_events_say_how_much_of_a_chain_a_server_holds():
    """The prefill server's probe (no engine thread): a run from the first hash, cache or own tiers."""
    log = KvEventLog()
    for h in (1, 2, 4):
        log.stored(h)
    log.tiered(3)
    assert log.held_run([1, 2, 3, 4, 5]) == 4
    log.evicted(2)
    assert log.held_run([1, 2, 3]) == 1 and log.held_run([]) == 0


def test_a_pinned_read_keeps_its_blocks_out_of_every_free_list_after_its_reservation_ends(tiny_model):
    """A read pins the 3 blocks holding D's cached 47 tokens (2 of 16 and the kept tail of 15); the
    reservation is aborted meanwhile: the pinned blocks count as reserved, a request taking every block
    left gets none of them, and their bytes are what they were; unpinned, every block is free again."""
    prefill, decode = engines(tiny_model)
    try:
        answer = prefill_remote(prefill, decode, "t1", TURN1, pull=False)
        turn2 = TURN1 + answer + NEW
        decode.reserve("t2", turn2, SAMPLING)
        assert decode.num_cached_tokens("t2") == 47
        before = decode.read_reserved("t2", 0, 47)
        read = decode.pin_reserved("t2", 5, 47)
        assert (len(read.block_ids), read.start, read.end) == (3, 5, 47)
        assert decode.block_counts() == {"free": 12 - 4, "reserved": 4, "running": 0}  # 59 tokens: 4 blocks
        decode.abort("t2")
        assert decode.block_counts() == {"free": 12 - 3, "reserved": 3, "running": 0}
        decode.check_integrity()
        taken = decode.reserve("other", [7] * (9 * 16 - 1), SAMPLING)  # every block left, evicting the cached ones
        assert not set(taken) & set(read.block_ids)
        with pytest.raises(NoCapacityError):
            decode.reserve("more", [5] * 8, SAMPLING)
        assert torch.equal(read.copy(), before[:, :, 5:])
        decode.abort("other")
        decode.unpin(read)
        with pytest.raises(KeyError):
            decode.unpin(read)
        all_free(prefill, decode)
    finally:
        prefill.close()
        decode.close()
