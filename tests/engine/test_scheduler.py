"""Scheduler: exact plans, block ids and counts, preemption, remote KV."""

import pytest

from engine.block_manager import BlockManager
from engine.request import ChunkResult, NoCapacityError, Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

EOS = 99


def make(num_blocks=8, block_size=4, budget=64, max_seqs=8, chunked=True, mode="colocated", max_len=64,
         prefix_caching=True):
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, chunked_prefill=chunked,
        max_model_len=max_len, mode=mode, eos_token_ids=(EOS,),
        prefix_caching=prefix_caching, cache_salt="model|float32",
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


def req(rid, n, max_tokens=8, **kw):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


def update(s, plan, tokens: dict[str, int]):
    """``s.update`` with the runner's result for a plan: ``tokens[request id]`` drawn for each sampling chunk."""
    return s.update(plan, {c.request: ChunkResult([tokens[c.request.request_id]]) for c in plan.chunks if c.sample})


def plan_shape(plan):
    return [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks]


def test_prompts_are_prefilled_then_decoded_one_token_per_step():
    s = make()
    s.add(req("a", 6))
    s.add(req("b", 3))
    plan = s.schedule()
    assert plan_shape(plan) == [("a", 0, 6, True), ("b", 0, 3, True)]
    assert s.requests["a"][0].block_ids == [0, 1] and s.requests["b"][0].block_ids == [2]
    update(s, plan, {"a": 10, "b": 11})
    plan = s.schedule()
    assert plan_shape(plan) == [("a", 6, 1, True), ("b", 3, 1, True)]
    assert s.requests["b"][0].block_ids == [2]  # b's 4th token still fits in its block
    update(s, plan, {"a": 12, "b": 13})
    assert plan_shape(s.schedule()) == [("a", 7, 1, True), ("b", 4, 1, True)]
    assert s.requests["b"][0].block_ids == [2, 3]  # b's 5th token opens a second block
    s.check_integrity()
    assert s.block_counts() == {"free": 4, "reserved": 0, "running": 4}


def test_chunked_prefill_respects_the_token_budget():
    s = make(budget=4)
    s.add(req("a", 10))
    shapes = []
    for _ in range(3):
        plan = s.schedule()
        shapes += plan_shape(plan)
        update(s, plan, {"a": 5})
    assert shapes == [("a", 0, 4, False), ("a", 4, 4, False), ("a", 8, 2, True)]
    assert s.requests["a"][0].output_token_ids == [5]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    s = make(budget=8, chunked=False)
    s.add(req("a", 6))
    s.add(req("b", 6))
    assert plan_shape(s.schedule()) == [("a", 0, 6, True)]


def test_eos_max_tokens_and_stop_ids_finish_and_free():
    s = make()
    s.add(req("eos", 4))
    s.add(req("len", 4, max_tokens=2))
    s.add(req("stop", 4, stop_token_ids=(7,)))
    outs = update(s, s.schedule(), {"eos": EOS, "len": 1, "stop": 7})
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [
        ("eos", True, "stop"), ("len", False, None), ("stop", True, "stop"),
    ]
    outs = update(s, s.schedule(), {"len": 2})
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("len", True, "length")]
    assert s.block_counts() == {"free": 8, "reserved": 0, "running": 0}
    s.check_integrity()


def test_ignore_eos_keeps_going():
    s = make()
    s.add(req("a", 4, ignore_eos=True))
    outs = update(s, s.schedule(), {"a": EOS})
    assert outs[0].finished is False


def test_context_limit_finishes_with_length():
    s = make(max_len=6)
    s.add(req("a", 5, max_tokens=100))
    outs = update(s, s.schedule(), {"a": 1})
    assert (outs[0].finished, outs[0].finish_reason) == (True, "length")


def test_running_sequence_cap():
    s = make(max_seqs=2)
    for rid in "abc":
        s.add(req(rid, 2))
    assert [c.request.request_id for c in s.schedule().chunks] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_frees_the_newest_request_and_recomputes_it_later():
    s = make(num_blocks=3, block_size=2, prefix_caching=False)  # with caching, see test_prefix_cache.py
    s.add(req("a", 2, max_tokens=5))
    s.add(req("b", 2, max_tokens=5))
    update(s, s.schedule(), {"a": 1, "b": 1})  # a -> [0], b -> [1]; each has 3 tokens now
    plan = s.schedule()  # a needs block 2 for its 3rd token; b needs one more: none left
    assert plan_shape(plan) == [("a", 2, 1, True)]
    assert plan.preempted == ["b"]
    b = s.requests["b"][0]
    assert (b.status, b.block_ids, b.num_computed, b.output_token_ids) == (RequestStatus.WAITING, [], 0, [1])
    assert s.requests["a"][0].block_ids == [0, 2]
    s.check_integrity()
    assert s.block_counts() == {"free": 1, "reserved": 0, "running": 2}
    update(s, plan, {"a": 2})
    s.abort("a")
    plan = s.schedule()  # b comes back: prompt + its one output token recomputed
    assert plan_shape(plan) == [("b", 0, 3, True)]
    update(s, plan, {"b": 4})
    assert s.requests["b"][0].output_token_ids == [1, 4]
    s.abort("b")
    s.check_integrity()
    assert s.block_counts()["free"] == 3


def test_reservation_waits_for_remote_kv_then_decodes():
    s = make(num_blocks=4, block_size=4)
    blocks = s.reserve(req("r", 7))  # 7 prompt tokens + the first token: 2 blocks
    assert blocks == [0, 1]
    assert s.block_counts() == {"free": 2, "reserved": 2, "running": 0}
    assert s.schedule().chunks == []
    (out,) = s.admit_remote("r", [42])
    assert (out.new_token_ids, out.finished) == ([42], False)
    assert s.requests["r"][0].num_computed == 7
    assert plan_shape(s.schedule()) == [("r", 7, 1, True)]
    assert s.block_counts() == {"free": 2, "reserved": 0, "running": 2}
    s.check_integrity()


def test_reservation_without_room_is_refused_and_leaves_nothing_behind():
    s = make(num_blocks=2, block_size=4)
    with pytest.raises(NoCapacityError):
        s.reserve(req("r", 8))
    assert s.block_counts() == {"free": 2, "reserved": 0, "running": 0}
    assert "r" not in s.requests


def test_aborting_a_reservation_frees_its_blocks():
    s = make()
    s.reserve(req("r", 5))
    assert s.abort("r")
    assert not s.abort("r")
    assert s.block_counts() == {"free": 8, "reserved": 0, "running": 0}
    with pytest.raises(KeyError):
        s.admit_remote("r", [1])
    s.check_integrity()


def test_prefill_mode_holds_blocks_until_released():
    s = make(mode="prefill")
    s.add(req("p", 6))
    outs = update(s, s.schedule(), {"p": 9})
    assert [(o.request_id, o.new_token_ids, o.finish_reason, o.block_ids) for o in outs] == [("p", [9], "prefilled", [0, 1])]
    assert s.block_counts() == {"free": 6, "reserved": 2, "running": 0}
    assert not s.has_unfinished()
    s.release("p")
    assert s.block_counts() == {"free": 8, "reserved": 0, "running": 0}
    s.check_integrity()


def test_n_sequences_fork_after_the_first_tokens_sharing_full_blocks_and_copying_the_partial_one():
    s = make(num_blocks=8, block_size=4)
    s.add(Request("a", list(range(1, 7)), SamplingParams(n=3, temperature=0)))  # block 0 full, block 1 partial
    plan = s.schedule()
    outs = s.update(plan, {plan.chunks[0].request: ChunkResult([10, 11, 12])})
    assert [(o.request_id, o.index, o.new_token_ids, o.finished) for o in outs] == [
        ("a", 0, [10], False), ("a", 1, [11], False), ("a", 2, [12], False)]
    assert [r.block_ids for r in s.requests["a"]] == [[0, 1], [0, 2], [0, 3]]
    assert [r.output_token_ids for r in s.requests["a"]] == [[10], [11], [12]]
    assert s.take_block_copies() == [(1, 2), (1, 3)] and s.take_block_copies() == []
    assert [s.blocks.blocks[i].ref_count for i in range(4)] == [3, 1, 1, 1]
    s.check_integrity()
    assert plan_shape(s.schedule()) == [("a", 6, 1, True)] * 3
    assert s.abort("a")
    assert s.block_counts() == {"free": 8, "reserved": 0, "running": 0}
    s.check_integrity()


def test_admit_remote_forks_the_reservation_into_its_n_sequences():
    s = make(num_blocks=8, block_size=4, mode="decode")
    assert s.reserve(Request("r", list(range(1, 9)), SamplingParams(n=2, temperature=0))) == [0, 1, 2]  # 8 + 1
    outs = s.admit_remote("r", [5, 6])
    assert [(o.index, o.new_token_ids) for o in outs] == [(0, [5]), (1, [6])]
    assert [r.block_ids for r in s.requests["r"]] == [[0, 1, 2], [0, 1]]  # nothing partial to copy
    assert s.take_block_copies() == []
    assert plan_shape(s.schedule()) == [("r", 8, 1, True)] * 2
    assert [r.block_ids for r in s.requests["r"]] == [[0, 1, 2], [0, 1, 3]]
    s.check_integrity()
