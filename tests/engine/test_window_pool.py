"""A model mixing sliding-window and full-attention layers (Gemma 3's shape: tiny-swa's layers 0, 1 and 3
slide over 8 tokens, layer 2 attends over everything) with ``window_kv_blocks``: its window layers keep
their blocks in a pool of their own (engine/window_pool.py) and hold only what their window reads. Greedy
tokens stay transformers' on prompts many windows long, with and without prefix caching, under preemption,
for several sequences of one prompt; the blocks held after each step are exactly those; every block of both
pools is back at the end; and the same KV bytes hold more long sequences at once than one block table."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.make_model import TINY_SWA, make_tiny
from engine.request import Request, window_start
from engine.window_pool import WindowPool
from tests.engine.oracle import hf_greedy

WINDOW, BS, LAYERS = 8, 4, 4
LAYER_BLOCK = 2 * BS * 2 * 16 * 4  # K and V of one layer's block: 2 KV heads of 16, float32
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(30)]
KV_BYTES_OF_70 = {None: 18 * 4 * LAYER_BLOCK, 24: (18 * 1 + 3 * 3) * LAYER_BLOCK}  # 73,728 and 27,648
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def swa(tmp_path_factory) -> str:
    return str(make_tiny(tmp_path_factory.mktemp("tiny-swa"), TINY_SWA))


def engine_of(path: str, **kw) -> LLMEngine:
    config = dict(model=path, block_size=BS, num_threads=1, max_num_batched_tokens=16, attention_backend="torch")
    return LLMEngine(EngineConfig(**{**config, **kw}))


def pooled(path: str, window_kv_blocks: int = 24, num_blocks: int = 64, **kw) -> LLMEngine:
    return engine_of(path, num_blocks=num_blocks, window_kv_blocks=window_kv_blocks, **kw)


def assert_all_back(engine: LLMEngine, num_blocks: int, window_blocks: int) -> None:
    engine.check_integrity()
    assert engine.block_counts() == {"free": num_blocks, "reserved": 0, "running": 0}
    pool = engine.scheduler.window_pool
    assert pool is not None and pool.blocks.num_free == pool.blocks.num_blocks == window_blocks


def window_held(num_computed: int) -> int:
    """Window blocks a sequence holds with ``num_computed`` tokens computed once the blocks before its next
    query's window are given back: from the one holding num_computed - WINDOW + 1 to its last token's."""
    return -(-num_computed // BS) - window_start(num_computed, WINDOW) // BS


def run_one(engine: LLMEngine, prompt: list[int], preempt_at: int | None = None):
    """Greedy tokens of one request and (tokens computed, full-layer blocks, window blocks) held after each
    step once its prompt was computed and the next step's release applied. ``preempt_at``: drop its blocks
    once it computed that many tokens; it is computed again from its tokens."""
    engine.add_request("r", prompt, GREEDY)
    pool = engine.scheduler.window_pool
    assert pool is not None
    tokens, seen = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        engine.check_integrity()
        (seq,) = engine.scheduler.requests.get("r", [None])
        if seq is None or seq.num_computed < len(prompt):
            continue
        pool.release(seq)
        seen.append((seq.num_computed, len(seq.held_block_ids), len(seq.held_window_block_ids)))
        if seq.num_computed == preempt_at:
            engine.scheduler._preempt(seq)
            engine.check_integrity()
    return tokens, seen


@pytest.mark.parametrize("backend, layout", [("torch", "NHD"), ("auto", "NHD"), ("torch", "HND")])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_window_layers_hold_only_their_window_and_answer_as_transformers(swa, backend, layout, prefix_caching):
    engine = pooled(swa, prefix_caching=prefix_caching, attention_backend=backend, kv_layout=layout)
    tokens, seen = run_one(engine, PROMPT)
    assert tokens == hf_greedy(swa, PROMPT, 40)
    assert [n for n, *_ in seen] == list(range(len(PROMPT), len(PROMPT) + 39))  # the last step finishes it
    assert seen == [(n, -(-n // BS), window_held(n)) for n, *_ in seen]
    # the full layer holds all 68 tokens (17 blocks), the window layers at most 3 blocks
    assert seen[-1] == (68, 17, 2) and max(w for *_, w in seen) == 3
    assert_all_back(engine, 64, 24)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_preempted_sequence_is_computed_again_to_the_same_answer(swa, prefix_caching):
    engine = pooled(swa, prefix_caching=prefix_caching)
    tokens, seen = run_one(engine, PROMPT, preempt_at=45)
    assert tokens == hf_greedy(swa, PROMPT, 40)
    assert (45, 12, window_held(45)) in seen and seen[-1] == (68, 17, 2)
    # its 46 tokens (30 + 16 drawn) computed again: all of them, or the 2 past the 44 its cached blocks hold
    # (the window blocks 9 and 10, keys 37..43, still cached too)
    assert engine.counters.prompt_tokens == 30 + (2 if prefix_caching else 46)
    assert_all_back(engine, 64, 24)


def test_a_prefix_hit_takes_the_window_blocks_its_next_query_reads(swa):
    engine = pooled(swa)
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == hf_greedy(swa, PROMPT, 40)
    # 7 full blocks cached; a hit of 28 tokens reads window keys 21..27: window blocks 5 and 6, still cached
    assert engine.cached_prefix(PROMPT) == 28
    engine.add_request("again", PROMPT, GREEDY)
    engine.step()
    (seq,) = engine.scheduler.requests["again"]
    assert seq.num_cached_tokens == 28 and seq.window_released == 5 and len(seq.held_window_block_ids) == 3
    tokens = seq.output_token_ids[:]
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        engine.check_integrity()
    assert tokens == hf_greedy(swa, PROMPT, 40)
    assert_all_back(engine, 64, 24)


def test_a_hit_is_taken_only_while_the_pool_holds_the_window_blocks_it_reads(swa):
    engine = pooled(swa)
    engine.generate([PROMPT], GREEDY)
    pool = engine.scheduler.window_pool
    assert pool is not None
    # The window blocks went to the LRU as the window left them, each release's last first: 1 0 | 4 3 2 | 5
    # 6 ... Evicting the five oldest leaves blocks 5 and 6, what a hit of 28 tokens reads (keys 21..27).
    evict_oldest(pool.blocks, 5)
    assert engine.cached_prefix(PROMPT) == 28
    # Without block 5 no hit is served: every shorter one reads an evicted block too.
    evict_oldest(pool.blocks, 1)
    assert len(engine.scheduler.blocks.match(engine.scheduler.prefix.hashes(probe(PROMPT), 7))) == 7
    assert engine.cached_prefix(PROMPT) == 0
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == hf_greedy(swa, PROMPT, 40)
    assert_all_back(engine, 64, 24)


def test_sequences_of_one_prompt_are_each_computed_to_the_same_answer(swa):
    engine = pooled(swa)
    results = engine.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=3))
    assert [r.token_ids for r in results] == [hf_greedy(swa, PROMPT, 20)] * 3
    assert_all_back(engine, 64, 24)


def test_the_same_bytes_hold_more_long_sequences_at_once(swa):
    budget = 64 * LAYERS * LAYER_BLOCK  # 64 blocks of every layer with one block table
    prompts = [[t + k for t in PROMPT] for k in range(6)]  # 6 answers of 70 tokens: 18 blocks each
    runs = {}
    for window_kv_blocks in (None, 24):
        engine = engine_of(swa, kv_cache_bytes=budget, window_kv_blocks=window_kv_blocks, prefix_caching=False)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        most = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            engine.check_integrity()
            most = max(most, sum(1 for r in engine.scheduler.running if r.num_computed >= r.num_prompt_tokens))
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == [hf_greedy(swa, p, 40) for p in prompts]
        runs[window_kv_blocks] = (engine.scheduler.blocks.num_blocks, most, engine.counters.preemptions)
        # a 70-token answer: 18 blocks of 4 layers; or 18 of the full layer and 3 of the 3 window layers
        assert engine.sequence_kv_bytes(70) == KV_BYTES_OF_70[window_kv_blocks]
    # One table: 64 blocks of 4 layers hold 3 sequences of 18 blocks; the 6 answers took turns, preempting 5
    # times. A window pool of 24 blocks of the 3 window layers leaves 256 - 72 = 184 blocks of the full layer:
    # the 6 decode at once, none preempted.
    assert runs == {None: (64, 5, 5), 24: (184, 6, 0)}


def test_window_kv_blocks_is_refused_where_it_cannot_serve(swa, tiny_model):
    with pytest.raises(ValueError, match="window_kv_blocks needs mode colocated"):
        EngineConfig(model=swa, mode="decode", window_kv_blocks=24)
    with pytest.raises(ValueError, match="mixing sliding-window and full-attention layers"):
        pooled(tiny_model)
    with pytest.raises(ValueError, match=r"window_kv_blocks 6 is fewer than one sequence's step may hold \(7"):
        pooled(swa, window_kv_blocks=6)
    engine = pooled(swa, window_kv_blocks=7)
    with pytest.raises(ValueError, match="serve colocated only"):
        engine.set_mode("decode")


def probe(prompt: list[int]) -> Request:
    return Request("probe", list(prompt), SamplingParams())


def evict_oldest(blocks: BlockManager, count: int) -> None:
    """Drop the ``count`` least recently freed cached blocks from the prefix cache, as the block manager does
    to make room: every block of the free heap and then those are handed out, and freed again."""
    blocks.free(blocks.allocate(blocks.num_free - blocks.num_cached_free + count))


def test_the_pool_s_bookkeeping_on_exact_block_ids():
    pool = WindowPool(BlockManager(8, BS), WINDOW)
    seq = Request("s", list(range(40)), SamplingParams())
    pool.grow(seq, 16)  # positions 0..15: blocks 0..3
    assert seq.window_block_ids == [0, 1, 2, 3] and pool.missing(seq, 22) == 2
    seq.num_computed = 16  # the next query, at 16, reads keys 9..16: blocks 2.. (placeholders before)
    pool.release(seq)
    assert (seq.window_released, seq.held_window_block_ids, pool.blocks.num_free) == (2, [2, 3], 6)
    hashes = [100 + i for i in range(4)]
    pool.register(seq, hashes, 0)  # the released blocks are not registered again (nor held)
    assert pool.blocks.match_all(hashes[2:]) == [2, 3] and pool.blocks.match_all(hashes) is None
    # a hit of 4 blocks (16 tokens) reads keys 9..15: blocks 2 and 3; of 3 blocks, keys 5..11: 1 is gone
    assert pool.hit(hashes) == [2, 3] and pool.hit(hashes[:3]) is None and pool.hit([]) == []
    other = Request("o", list(range(40)), SamplingParams())
    pool.take(other, 4, [2, 3])
    assert (other.window_block_ids[2:], other.window_released, pool.blocks.blocks[2].ref_count) == ([2, 3], 2, 2)
    pool.free(seq)
    pool.free(other)
    assert seq.window_block_ids == other.window_block_ids == [] and other.window_released == 0
    assert (pool.blocks.num_free, pool.blocks.num_cached_free) == (8, 2)  # 2 and 3 still findable
    pool.check_integrity([seq, other])
