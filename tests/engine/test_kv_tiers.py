"""KV tiers (engine/tiers/): blocks the prefix cache evicts come back from host memory or disk, exactly.

An engine whose cache holds two prompts' worth of blocks runs prompt A, then B, C and D
(which evict A's blocks into the tiers), then A again: A's blocks are loaded from a
tier, only its last block's tokens are computed, and the greedy tokens equal
transformers' (float32) every time; for a plain model, one with latent attention
(MLA) and one whose every layer slides, in both cache orders, and in bfloat16
(against the same engine computing them). A corrupted, truncated or vanished
disk entry is counted and its block recomputed; a restarted engine on the same
folder serves what the last one wrote; blocks a prefill server pushes may come
from its tier; a block whose window layers arrived only in part is never
tiered. Every scenario ends with every block free.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.config import KvTiersConfig
from engine.make_model import TINY_MLA, TINY_SWA, TinySpec, make_tiny
from engine.prefix_cache import chain_hashes
from engine.request import Request
from engine.tiers.disk import HEADER
from tests.engine.oracle import hf_greedy
from tests.engine.remote_kv import copy_prompt_kv
from tests.engine.test_window_remote_kv import PROMPT, WINDOW, remote_tokens

BS = 8
NUM_BLOCKS = 12  # two prompts of 40 tokens and their 8 answers: a third evicts the first
SAMPLING = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompt(k: int) -> list[int]:
    """40 tokens, 5 full blocks, sharing nothing with another ``k``."""
    return [(13 * i + 97 * k) % 450 + 7 for i in range(40)]


A, B, C, D = prompt(0), prompt(1), prompt(2), prompt(3)
A_LOADED = (len(A) - 1) // BS * BS  # 32: A's last block holds its last token, always computed


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory) -> str:
    return str(make_tiny(tmp_path_factory.mktemp("tiers-mla"), TINY_MLA))


@pytest.fixture(scope="module")
def mistral_swa(tmp_path_factory) -> str:
    """Every layer slides (window 8): decoding releases blocks the window has left."""
    return str(make_tiny(tmp_path_factory.mktemp("tiers-swa"), TinySpec(arch="mistral", seed=2, sliding_window=8)))


def tiers_config(tier: str, tmp_path, disk_bytes: int = 1 << 24) -> KvTiersConfig:
    if tier == "host":
        return KvTiersConfig(host_bytes=1 << 24)
    return KvTiersConfig(disk_path=str(tmp_path / "kv"), disk_bytes=disk_bytes)


def engine_with(path: str, tiers: KvTiersConfig | None, **knobs) -> LLMEngine:
    base = dict(model=path, block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=1, num_threads=1, kv_tiers=tiers)
    return LLMEngine(EngineConfig(**{**base, **knobs}))


def run(engine: LLMEngine, path: str, tokens: list[int]) -> None:
    """Generate for one prompt and check it against transformers."""
    assert engine.generate([tokens], SAMPLING)[0].token_ids == hf_greedy(path, tokens, 8, ignore_eos=True)


def evict_a(engine: LLMEngine, path: str) -> None:
    """A, then B, C and D, which push every block of A out of the cache into the tiers."""
    for tokens in (A, B, C, D):
        run(engine, path, tokens)
    assert engine.tiers is not None and engine.tiers.drain()


def assert_all_free(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert engine.block_counts() == {"free": NUM_BLOCKS, "reserved": 0, "running": 0}


def disk_file(engine: LLMEngine, block: int) -> Path:
    """The disk tier's file of A's ``block``-th block."""
    disk = engine.tiers.tiers[-1]
    return disk.path(chain_hashes(engine.config.cache_salt, A, BS)[block])


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("model", ["tiny_model", "tiny_mla", "mistral_swa"])
def test_blocks_evicted_to_a_tier_come_back_and_tokens_equal_transformers(request, tmp_path, model, tier):
    path = request.getfixturevalue(model)
    engine = engine_with(path, tiers_config(tier, tmp_path))
    try:
        evict_a(engine, path)
        before = engine.stats().counters
        run(engine, path, A)
        after = engine.stats().counters
        assert after.tier_hits_tokens - before.tier_hits_tokens == A_LOADED
        assert after.prompt_tokens - before.prompt_tokens == len(A) - A_LOADED  # only A's last block
        (stats,) = engine.stats().tiers
        assert (stats.name, stats.hits, stats.corrupt, stats.dropped_writes) == (tier, A_LOADED // BS, 0, 0)
        assert stats.bytes_read == A_LOADED // BS * engine.tiers.block_nbytes
        assert_all_free(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_hnd_cache_round_trips_through_a_tier(tiny_model, tmp_path, tier):
    engine = engine_with(tiny_model, tiers_config(tier, tmp_path), kv_layout="HND")
    try:
        evict_a(engine, tiny_model)
        run(engine, tiny_model, A)
        assert engine.stats().counters.tier_hits_tokens == A_LOADED
        assert_all_free(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_bfloat16_blocks_from_a_tier_give_the_tokens_computing_them_gives(tiny_model, tmp_path, tier):
    """No float32 oracle for bfloat16: the same engine's tokens with A computed are the reference."""
    engine = engine_with(tiny_model, tiers_config(tier, tmp_path), dtype="bfloat16")
    try:
        computed = engine.generate([A], SAMPLING)[0].token_ids
        for tokens in (B, C, D):
            engine.generate([tokens], SAMPLING)
        assert engine.tiers is not None and engine.tiers.drain()
        assert engine.generate([A], SAMPLING)[0].token_ids == computed
        assert engine.stats().counters.tier_hits_tokens == A_LOADED
        assert_all_free(engine)
    finally:
        engine.close()


def test_host_then_disk_each_serve_and_count(tiny_model, tmp_path):
    """With both tiers a block is written to both; the host tier serves it first."""
    tiers = KvTiersConfig(host_bytes=1 << 24, disk_path=str(tmp_path / "kv"), disk_bytes=1 << 24)
    engine = engine_with(tiny_model, tiers)
    try:
        evict_a(engine, tiny_model)
        run(engine, tiny_model, A)
        host, disk = engine.stats().tiers
        assert (host.hits, disk.hits) == (4, 0)
        assert host.entries == disk.entries > 0
        assert_all_free(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "damage, loaded",
    [
        ("flip_a_payload_byte", 1),  # block 1 of A is corrupt: block 0 loads, the rest is computed
        ("truncate", 0),  # block 0 of A is cut short: nothing loads
        ("delete", 2),  # block 2 of A's file vanished: blocks 0 and 1 load
    ],
)
def test_a_damaged_disk_entry_is_recomputed_counted_and_never_served(tiny_model, tmp_path, damage, loaded):
    engine = engine_with(tiny_model, tiers_config("disk", tmp_path))
    try:
        evict_a(engine, tiny_model)
        target = disk_file(engine, loaded)
        raw = bytearray(target.read_bytes())
        if damage == "flip_a_payload_byte":
            raw[HEADER.size + 5] ^= 0x40
            target.write_bytes(bytes(raw))
        elif damage == "truncate":
            target.write_bytes(bytes(raw[: len(raw) // 2]))
        else:
            target.unlink()
        before = engine.stats().counters
        run(engine, tiny_model, A)
        after = engine.stats().counters
        assert after.tier_hits_tokens - before.tier_hits_tokens == loaded * BS
        assert after.prompt_tokens - before.prompt_tokens == len(A) - loaded * BS
        (disk,) = engine.stats().tiers
        assert (disk.hits, disk.corrupt) == (loaded, 1)
        assert not target.exists()  # a corrupt entry is removed, not kept to fail again
        assert_all_free(engine)
    finally:
        engine.close()


def test_a_restarted_engine_serves_what_the_last_one_wrote_to_disk(tiny_model, tmp_path):
    first = engine_with(tiny_model, tiers_config("disk", tmp_path))
    try:
        evict_a(first, tiny_model)
    finally:
        first.close()
    second = engine_with(tiny_model, tiers_config("disk", tmp_path))
    try:
        run(second, tiny_model, A)
        assert second.stats().counters.tier_hits_tokens == A_LOADED
        assert_all_free(second)
    finally:
        second.close()


def test_the_disk_tier_stays_within_its_bytes_and_keeps_the_newest(tiny_model, tmp_path):
    probe = engine_with(tiny_model, None)
    per_file = HEADER.size + probe.cache.kv[:, :, 0].numel() * probe.cache.kv.element_size()
    engine = engine_with(tiny_model, tiers_config("disk", tmp_path, disk_bytes=3 * per_file))
    try:
        evict_a(engine, tiny_model)
        (disk,) = engine.stats().tiers
        files = list(engine.tiers.tiers[0].folder.glob("*.kv"))
        assert disk.entries == len(files) == 3 and disk.evictions > 0
        assert disk.bytes_held == sum(f.stat().st_size for f in files) <= 3 * per_file
        run(engine, tiny_model, A)  # A's blocks were written first and are gone: all computed, still exact
        assert engine.stats().counters.tier_hits_tokens == 0
        assert_all_free(engine)
    finally:
        engine.close()


def test_prompt_logprobs_take_nothing_from_a_tier(tiny_model, tmp_path):
    engine = engine_with(tiny_model, tiers_config("host", tmp_path))
    try:
        evict_a(engine, tiny_model)
        engine.add_request("scored", A, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        while engine.has_unfinished():
            engine.step()
        assert engine.stats().counters.tier_hits_tokens == 0
        assert_all_free(engine)
    finally:
        engine.close()


def test_tiers_need_one_rank_and_name_a_tier():
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(model="m", tensor_parallel_size=2, kv_tiers=KvTiersConfig(host_bytes=1 << 20))
    with pytest.raises(ValueError, match="names no tier"):
        KvTiersConfig()
    with pytest.raises(ValueError, match="go together"):
        KvTiersConfig(disk_path="/tmp/x")


def test_the_block_manager_tells_each_evicted_block_holding_every_layer_before_reuse():
    blocks, told = BlockManager(num_blocks=3, block_size=4), []
    blocks.on_evict = lambda block_id, h: told.append((block_id, h, blocks.blocks[block_id].block_hash))
    ids = blocks.allocate(3)
    for block_id, h in zip(ids, (11, 12, 13)):
        blocks.cache(block_id, h)
    blocks.blocks[ids[1]].window_from = 2  # its window layers hold only slots 2.. (a remote prompt's)
    blocks.free(ids)  # LRU, oldest first: 2, 1, 0
    assert blocks.allocate(3) == [2, 1, 0]
    assert told == [(2, 13, 13), (0, 11, 11)]  # told while the hash is still held; block 1 never
    blocks.free([0, 1, 2])
    blocks.check_integrity()
    assert blocks.num_free == 3


def prefill_once(engine: LLMEngine, request_id: str, tokens: list[int], hook=None):
    """A prefill-mode engine's one output for ``tokens`` (its blocks still held)."""
    engine.add_request(request_id, tokens, SAMPLING)
    outs: list = []
    while not outs:
        outs = engine.step(hook)
    (out,) = outs
    assert out.finish_reason == "prefilled"
    return out


def test_a_prefill_server_pushes_blocks_a_tier_served_and_decode_continues_exactly(tiny_model, tmp_path):
    """P's blocks of A come from its disk tier; the chunk it hands the transfer starts at token 0, so
    D gets them too; D's greedy tokens equal transformers'."""
    prefill = LLMEngine(
        EngineConfig(
            model=tiny_model,
            block_size=BS,
            num_blocks=NUM_BLOCKS,
            num_threads=1,
            mode="prefill",
            kv_tiers=tiers_config("disk", tmp_path),
        )
    )
    decode = LLMEngine(EngineConfig(model=tiny_model, block_size=16, num_blocks=16, num_threads=1, mode="decode"))
    try:
        for k, tokens in enumerate((A, B, C, D)):
            prefill_once(prefill, f"warm{k}", tokens)
            prefill.release(f"warm{k}")
        assert prefill.tiers is not None and prefill.tiers.drain()
        blocks = decode.reserve("r", A, SAMPLING)
        pushed: list[tuple[int, int]] = []
        out = prefill_once(prefill, "r", A, lambda layer, chunks: pushed.extend((c.start, c.end) for c in chunks))
        assert prefill.stats().counters.tier_hits_tokens == A_LOADED
        assert set(pushed) == {(0, len(A))}  # every layer's chunk: the loaded prefix and the computed rest
        copy_prompt_kv(prefill, out.block_ids, decode, blocks, len(A))
        prefill.release("r")
        (first,) = decode.admit_remote("r", out.new_token_ids)
        tokens = list(first.new_token_ids)
        while decode.has_unfinished():
            tokens += [t for o in decode.step() for t in o.new_token_ids]
        assert tokens == hf_greedy(tiny_model, A, 8, ignore_eos=True)
        for engine in (prefill, decode):
            engine.check_integrity()
            assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}
    finally:
        prefill.close()
        decode.close()


def test_blocks_whose_window_layers_came_partly_from_a_prefill_server_are_never_tiered(tmp_path):
    """A decode engine's remote prompt holds window-layer K/V only from its last ``window - 1`` tokens on (the
    slots before hold garbage): when those blocks are evicted, only the blocks holding every layer are written,
    so a later prompt sharing the start finds nothing in the tier, computes it, and stays exact."""
    swa = str(make_tiny(tmp_path / "swa", TINY_SWA))
    decode = LLMEngine(
        EngineConfig(model=swa, block_size=4, num_blocks=24, num_threads=1, kv_tiers=KvTiersConfig(host_bytes=1 << 24))
    )
    try:
        first_read = len(PROMPT) - WINDOW + 1  # 63: blocks 0..15 lack window-layer K/V somewhere
        assert remote_tokens(swa, PROMPT, first_read, decode) == hf_greedy(swa, PROMPT, 12)
        for k in range(2):  # two prompts of 80 tokens evict every block of the remote prompt
            filler = [(7 * i + 5 * k) % 300 + 11 for i in range(80)]
            assert decode.generate([filler], SAMPLING)[0].token_ids == hf_greedy(swa, filler, 8, ignore_eos=True)
        assert decode.tiers is not None and decode.tiers.drain()
        hashes = chain_hashes(decode.config.cache_salt, PROMPT, 4)
        tiered = [i for i, h in enumerate(hashes) if decode.tiers.available([h])]
        assert tiered and min(tiered) == 16  # the first block whose every slot every layer holds
        shorter = PROMPT[:40] + [5, 6, 7]
        assert decode.generate([shorter], SAMPLING)[0].token_ids == hf_greedy(swa, shorter, 8, ignore_eos=True)
        assert decode.stats().counters.tier_hits_tokens == 0
        decode.check_integrity()
        assert decode.block_counts() == {"free": 24, "reserved": 0, "running": 0}
    finally:
        decode.close()


def remote_prompt(
    prefill: LLMEngine, decode: LLMEngine, request_id: str, tokens: list[int], sampling: SamplingParams = SAMPLING
) -> list[int]:
    """``tokens`` through a prefill engine into the decode engine's reservation, only the tokens past what
    the decode engine holds copied (as a transfer writes them); the decode engine's tokens."""
    blocks = decode.reserve(request_id, tokens, sampling)
    held = decode.num_cached_tokens(request_id)
    out = prefill_once(prefill, request_id, tokens)
    for p in range(held, len(tokens)):  # source and destination both NHD blocks of BS
        decode.cache.kv[:, :, blocks[p // BS], p % BS] = prefill.cache.kv[:, :, out.block_ids[p // BS], p % BS]
    prefill.release(request_id)
    (first,) = decode.admit_remote(request_id, out.new_token_ids)
    produced = list(first.new_token_ids)
    while decode.has_unfinished():
        produced += [t for o in decode.step() for t in o.new_token_ids]
    return produced


def test_a_decode_reservation_holds_blocks_its_tier_served_and_the_rest_arrives_remotely(tiny_model, tmp_path):
    """D's reservation for A, after A's blocks left D's cache for its tier, pins the 4 blocks the tier served
    (num_cached_tokens 32): only tokens 32..39 are written remotely, and the tokens equal transformers'."""
    prefill = engine_with(tiny_model, None, mode="prefill", num_blocks=16)
    decode = engine_with(tiny_model, tiers_config("disk", tmp_path), mode="decode")
    try:
        for k, tokens in enumerate((A, B, C, D)):
            assert remote_prompt(prefill, decode, f"warm{k}", tokens) == hf_greedy(tiny_model, tokens, 8, True)
        assert decode.tiers is not None and decode.tiers.drain()
        assert decode.cached_prefix(A) == A_LOADED  # all of it in the tier, none in the cache
        assert decode.scheduler.cached_prefix_tokens(_probe(A)) == A_LOADED
        before = decode.stats().counters.tier_hits_tokens
        assert remote_prompt(prefill, decode, "again", A) == hf_greedy(tiny_model, A, 8, ignore_eos=True)
        assert decode.stats().counters.tier_hits_tokens - before == A_LOADED
        for engine in (prefill, decode):
            engine.check_integrity()
            assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}
    finally:
        prefill.close()
        decode.close()


def _probe(tokens: list[int]) -> Request:
    return Request("probe", list(tokens), SAMPLING)


def test_the_block_manager_tells_each_cached_block_whose_last_owner_frees_it():
    blocks, told = BlockManager(num_blocks=4, block_size=4), []
    blocks.on_cached = lambda block_id, h: told.append((block_id, h))
    ids = blocks.allocate(3)
    for block_id, h in zip(ids[:2], (21, 22)):
        blocks.cache(block_id, h)
    blocks.share(ids[:1])  # a second owner of block 0
    blocks.blocks[ids[1]].window_from = 1
    blocks.free(ids)  # block 2 holds no hash; block 1 not every layer's K/V; block 0 still owned
    assert told == []
    blocks.free(ids[:1])
    assert told == [(0, 21)]
    blocks.check_integrity()
    assert blocks.num_free == 4
