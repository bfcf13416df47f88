"""A tensor-parallel engine computes what one rank computes: transformers' greedy tokens, the same
log-probabilities, forks and prefix hits copied on every rank; a rank that dies fails it.
(Ranks ending with a killed leader: tests/cluster/test_tensor_parallel_cluster.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.make_model import TinySpec, make_tiny
from engine.tensor_parallel import Shard, kv_heads_for_rank, split_problem
from engine.tp_wire import StepInputs, decode, encode
from tests.engine.oracle import hf_greedy
from tests.waiting import wait_until
from transfer.layout import KVLayout

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (1, 5, 17, 40, 100)]


def engine_config(path: str, tp: int, **kw) -> EngineConfig:
    base = dict(model=path, tensor_parallel_size=tp, block_size=16, num_blocks=96, num_threads=1)
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "total,rank,size,heads",
    [(8, 0, 2, (0, 1, 2, 3)), (8, 1, 2, (4, 5, 6, 7)), (2, 3, 4, (1,)), (2, 0, 4, (0,)), (1, 1, 2, (0,))],
)
def test_a_rank_holds_its_share_of_kv_heads_or_one_replicated(total, rank, size, heads):
    assert kv_heads_for_rank(total, rank, size) == heads


@pytest.mark.parametrize(
    "heads,kv_heads,size,message",
    [
        (8, 6, 4, "6 KV heads cannot be split evenly over tensor_parallel_size=4"),
        (8, 4, 8, None),
        (12, 4, 6, "tensor_parallel_size=6 is not a multiple of the model's 4 KV heads"),
    ],
)
def test_kv_heads_that_do_not_split_over_the_ranks_are_refused(heads, kv_heads, size, message):
    assert split_problem(heads, kv_heads, 8 * size, size) == message


def test_a_model_that_does_not_divide_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="4 attention heads cannot be split evenly over tensor_parallel_size=3"):
        LLMEngine(engine_config(tiny_model, 3))


def test_step_inputs_survive_their_encoding():
    inputs = StepInputs(
        token_ids=[5, 6, 7, 8],
        positions=[9, 0, 1, 2],
        slots=[41, 64, 65, 66],
        logits_rows=[0, 3],
        prefills=[(1, 3, 0, [4])],
        decodes=[(0, [10], [[2, 7]])],
        copies=[(3, 9), (4, 11)],
    )
    assert decode(encode(inputs)) == inputs
    assert decode(encode(StepInputs())) == StepInputs()


def test_shards_cover_the_model_once():
    # 4 query heads, 2 KV heads, over 4 ranks: one query head each, KV heads replicated twice
    shards = [Shard(r, 4) for r in range(4)]
    assert [list(s.q_heads(4)) for s in shards] == [[0], [1], [2], [3]]
    assert [s.kv_heads(2) for s in shards] == [(0,), (0,), (1,), (1,)]
    assert [s.vocab(10) for s in shards] == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]


@pytest.fixture(scope="module")
def tp2(tiny_model):
    engine = LLMEngine(engine_config(tiny_model, 2, max_num_batched_tokens=24))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tp1(tiny_model):
    return LLMEngine(engine_config(tiny_model, 1, max_num_batched_tokens=24))


def test_two_ranks_give_transformers_greedy_tokens_with_chunked_prefill(tiny_model, tp2):
    got = [r.token_ids for r in tp2.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0))]
    assert got == [hf_greedy(tiny_model, p, MAX_NEW) for p in PROMPTS]
    tp2.check_integrity()
    assert tp2.block_counts() == {"free": 96, "reserved": 0, "running": 0}


def test_two_ranks_give_one_ranks_logprobs_forks_and_prefix_hits(tp1, tp2):
    prompt = PROMPTS[3]  # 40 tokens: two full blocks are cached by the first request, reused by the second
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=3, n=3, seed=7)
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, n=3, seed=11)
    results = {}
    for name, engine in (("tp1", tp1), ("tp2", tp2)):
        outputs = []
        for i, params in enumerate((sampling, seeded, sampling)):
            engine.add_request(f"r{i}", prompt, params)
            while engine.has_unfinished():
                outputs += engine.step()
        results[name] = outputs
        engine.check_integrity()
        assert engine.block_counts() == {"free": 96, "reserved": 0, "running": 0}
    one, two = results["tp1"], results["tp2"]
    assert [(o.request_id, o.index, o.new_token_ids) for o in one] == [
        (o.request_id, o.index, o.new_token_ids) for o in two
    ]
    assert tp2.counters.prefix_hits_tokens >= 64  # the repeated prompt's two full blocks came from the cache
    for a, b in zip(one, two):
        for la, lb in zip(a.logprobs or [], b.logprobs or []):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            assert [v for _, v in la.top] == pytest.approx([v for _, v in lb.top], abs=1e-4)


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory) -> str:
    """A tiny Llama with 2 query heads sharing 1 KV head: two ranks must both hold it."""
    spec = TinySpec(arch="llama", seed=2, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    return str(make_tiny(tmp_path_factory.mktemp("tiny-llama-1kv"), spec))


def test_more_ranks_than_kv_heads_replicate_them(one_kv_head_model):
    engine = LLMEngine(engine_config(one_kv_head_model, 2))
    try:
        cache = engine.cache  # rank 0's slice, described to a transfer layer as rank 0 of 2
        assert cache.kv.shape[4] == 1 and cache.head_ids == (0,)
        layout = KVLayout.for_engine_cache(
            num_layers=cache.num_layers,
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            num_kv_heads=cache.num_kv_heads,
            head_dim=cache.head_dim,
            dtype=cache.dtype,
            order=cache.order,
            tp_rank=cache.tp_rank,
            tp_size=cache.tp_size,
            num_kv_heads_total=cache.num_kv_heads_total,
            head_ids=cache.head_ids,
        )
        assert (layout.head_ids, layout.tp_rank, layout.tp_size) == ((0,), 0, 2)
        got = [r.token_ids for r in engine.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_NEW, temperature=0))]
        assert got == [hf_greedy(one_kv_head_model, p, MAX_NEW) for p in PROMPTS[:3]]
        assert engine.block_counts() == {"free": 96, "reserved": 0, "running": 0}
    finally:
        engine.close()


def test_a_killed_rank_fails_the_engine(tp2):  # the last test of the module's two-rank engine
    (pid,) = tp2.ranks.pids
    assert tp2.rank_problem() is None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: tp2.rank_problem() is not None, timeout=30)
    assert f"rank 1 (pid {pid}) exited with status -9" in tp2.rank_problem()
    tp2.add_request("after", PROMPTS[1], SamplingParams(max_tokens=2, temperature=0))
    with pytest.raises((BrokenPipeError, RuntimeError)):
        tp2.step()
