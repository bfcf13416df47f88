"""With prefix caching on, greedy tokens still equal transformers `generate`, exactly."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.oracle import hf_greedy

BS = 8
BASE = [(13 * i) % 450 + 7 for i in range(40)]  # 5 full blocks of 8
SAMPLING = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_threads", 1)
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", BS)
    return LLMEngine(EngineConfig(model=path, **kw))


def tail(n: int, k: int) -> list[int]:
    return [(17 * i + k) % 450 + 30 for i in range(n)]


# name: (prompt, tokens found cached once BASE ran)
CASES = {
    "shares_nothing": (tail(20, 1), 0),
    "shares_part_of_a_block": (BASE[:5] + tail(12, 2), 0),
    "shares_exactly_three_blocks": (BASE[:24] + tail(9, 3), 24),
    "holds_all_of_base": (BASE + tail(6, 4), 40),
    "is_base_again": (list(BASE), 32),  # the last token is computed: 4 blocks reused, not 5
}


@pytest.mark.parametrize("case", CASES)
def test_a_prompt_after_another_reuses_its_blocks_and_stays_exact(tiny_model, case):
    prompt, hits = CASES[case]
    e = engine(tiny_model)
    assert e.generate([BASE], SAMPLING)[0].token_ids == hf_greedy(tiny_model, BASE, 8, ignore_eos=True)
    before = e.stats().counters
    assert (before.prefix_queries_tokens, before.prefix_hits_tokens) == (40, 0)
    assert e.generate([prompt], SAMPLING)[0].token_ids == hf_greedy(tiny_model, prompt, 8, ignore_eos=True)
    after = e.stats().counters
    assert (after.prefix_queries_tokens - 40, after.prefix_hits_tokens) == (len(prompt), hits)
    assert after.prompt_tokens - before.prompt_tokens == len(prompt) - hits  # only the rest was computed
    e.check_integrity()
    assert e.block_counts() == {"free": 64, "reserved": 0, "running": 0}


def test_identical_prompts_arriving_at_once_are_exact(tiny_model):
    e = engine(tiny_model)
    results = e.generate([BASE, BASE, BASE + tail(3, 5), BASE], SAMPLING)
    ref = hf_greedy(tiny_model, BASE, 8, ignore_eos=True)
    longer = hf_greedy(tiny_model, BASE + tail(3, 5), 8, ignore_eos=True)
    assert [r.token_ids for r in results] == [ref, ref, longer, ref]
    e.check_integrity()
    assert e.block_counts() == {"free": 64, "reserved": 0, "running": 0}


def test_multi_turn_reuses_the_previous_turn_and_its_answer(tiny_model):
    e = engine(tiny_model)
    prompt, hits, computed = list(BASE), [], []
    for turn in range(3):
        before = e.stats().counters
        answer = e.generate([prompt], SAMPLING)[0].token_ids
        assert answer == hf_greedy(tiny_model, prompt, 8, ignore_eos=True)
        after = e.stats().counters
        hits.append(after.prefix_hits_tokens - before.prefix_hits_tokens)
        computed.append(after.prompt_tokens - before.prompt_tokens)
        assert hits[-1] + computed[-1] == len(prompt)
        prompt = prompt + answer + tail(5, turn)
    # A turn reuses the turn before, prompt and answer, as far as K/V was computed: all but the answer's
    # last token (sampled, never fed back). Turn 1: 5 whole blocks and the kept tail of block 5 (the
    # answer's first 7 tokens); turn 2: 7 whole blocks and the tail of block 7 (4 tokens). Only the new
    # tokens are computed: the answer's last one and the 5 of the new question.
    assert hits == [0, 40 + 7, 56 + 4]
    assert computed == [40, 6, 6]
    e.check_integrity()
    assert e.block_counts() == {"free": 64, "reserved": 0, "running": 0}


def test_cache_far_smaller_than_the_working_set_evicts_and_stays_exact(tiny_model):
    e = engine(tiny_model, num_blocks=12, max_num_seqs=2)  # 96 tokens of cache
    prompts = [BASE[: 16 + 8 * (k % 3)] + tail(10, k) for k in range(8)]  # about 300 tokens in all
    prompts += [prompts[6], prompts[7], prompts[0]]
    results = e.generate(prompts, SAMPLING)
    assert [r.token_ids for r in results] == [hf_greedy(tiny_model, p, 8, ignore_eos=True) for p in prompts]
    assert e.scheduler.blocks.evictions > 0
    assert e.stats().counters.prefix_hits_tokens > 0
    e.check_integrity()
    assert e.block_counts() == {"free": 12, "reserved": 0, "running": 0}


def test_preemption_with_a_shared_prefix_stays_exact(tiny_model):
    prompts = [BASE[:16] + tail(6, k) for k in range(4)]
    e = engine(tiny_model, block_size=4, num_blocks=20, max_num_batched_tokens=64)
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = e.generate(prompts, sampling)
    assert e.stats().counters.preemptions > 0
    assert e.stats().counters.prefix_hits_tokens > 0
    assert [r.token_ids for r in results] == [hf_greedy(tiny_model, p, 16, ignore_eos=True) for p in prompts]
    e.check_integrity()
    assert e.block_counts() == {"free": 20, "reserved": 0, "running": 0}


def test_caching_off_computes_every_prompt_token(tiny_model):
    e = engine(tiny_model, prefix_caching=False)
    e.generate([BASE], SAMPLING)
    assert e.generate([BASE], SAMPLING)[0].token_ids == hf_greedy(tiny_model, BASE, 8, ignore_eos=True)
    c = e.stats().counters
    assert (c.prompt_tokens, c.prefix_queries_tokens, c.prefix_hits_tokens, e.stats().scheduler.cached) == (80, 0, 0, 0)


@pytest.mark.parametrize("src_bs,dst_bs", [(16, 8), (4, 16)])
def test_decode_engine_holding_a_prefix_needs_only_the_rest_from_a_prefill_engine(tiny_model, src_bs, dst_bs):
    prefill = engine(tiny_model, block_size=src_bs, mode="prefill")
    decode = engine(tiny_model, block_size=dst_bs, mode="decode")
    decode.generate([BASE[:30]], SAMPLING)  # D now holds BASE's first whole blocks of dst_bs
    prompt = BASE + tail(7, 6)
    blocks = decode.reserve("r", prompt, SAMPLING)
    cached = decode.num_cached_tokens("r")
    assert cached == 29 // dst_bs * dst_bs and cached > 0
    prefill.add_request("r", prompt, SAMPLING)
    (out,) = prefill.step()
    src, dst = out.block_ids, blocks
    for p in range(cached, len(prompt)):  # only what D lacks, token by token as the transfer layer places it
        decode.cache.kv[:, :, dst[p // dst_bs], p % dst_bs] = prefill.cache.kv[:, :, src[p // src_bs], p % src_bs]
    prefill.release("r")
    (first,) = decode.admit_remote("r", out.new_token_ids)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == hf_greedy(tiny_model, prompt, 8, ignore_eos=True)
    for e in (prefill, decode):
        e.check_integrity()
        assert e.block_counts() == {"free": 64, "reserved": 0, "running": 0}
