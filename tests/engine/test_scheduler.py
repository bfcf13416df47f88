"""Scheduler: exact plans, block ids and counts, preemption, remote KV."""

import pytest

from engine.request import ChunkResult, NoCapacityError, Request, RequestStatus, SamplingParams
from tests.engine.scheduling import EOS, make, plan_shape, update


def req(rid, n, max_tokens=8, **kw):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


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
        ("eos", True, "stop"),
        ("len", False, None),
        ("stop", True, "stop"),
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
    s = make(num_blocks=4, block_size=2, prefix_caching=False)  # with caching, see test_prefix_cache.py
    s.add(req("a", 2, max_tokens=5))
    s.add(req("b", 2, max_tokens=5))
    for token in (1, 2, 3):  # then a and b hold 2 blocks each, the whole cache, with 5 tokens each
        update(s, s.schedule(), {"a": token, "b": token})
    plan = s.schedule()  # a needs a 3rd block for its 5th token: b, as large and newer, yields its two
    assert plan_shape(plan) == [("a", 4, 1, True)]
    assert plan.preempted == ["b"]
    b = s.requests["b"][0]
    assert (b.status, b.block_ids, b.num_computed, b.output_token_ids) == (RequestStatus.WAITING, [], 0, [1, 2, 3])
    assert len(s.requests["a"][0].block_ids) == 3
    s.check_integrity()
    assert s.block_counts() == {"free": 1, "reserved": 0, "running": 3}
    update(s, plan, {"a": 4})
    s.abort("a")
    plan = s.schedule()  # b comes back: prompt + its three output tokens recomputed
    assert plan_shape(plan) == [("b", 0, 5, True)]
    update(s, plan, {"b": 4})
    assert s.requests["b"][0].output_token_ids == [1, 2, 3, 4]
    s.abort("b")
    s.check_integrity()
    assert s.block_counts()["free"] == 4


def test_a_request_holding_more_than_an_equal_share_of_the_cache_is_preempted_first():
    s = make(num_blocks=6, block_size=2, prefix_caching=False)
    s.add(req("greedy", 6, max_tokens=10))
    s.add(req("short", 2))
    for token in (1, 2, 3):  # then greedy holds 4 blocks and short 2: the whole cache
        update(s, s.schedule(), {"greedy": token, "short": token})
    plan = s.schedule()  # greedy needs a 5th block: it holds more than half the cache, so it yields, not short
    assert plan.preempted == ["greedy"]
    assert plan_shape(plan) == [("short", 4, 1, True)]
    assert s.requests["greedy"][0].status is RequestStatus.WAITING
    s.check_integrity()
    assert s.block_counts() == {"free": 3, "reserved": 0, "running": 3}
    s.abort("greedy")
    s.abort("short")
    assert s.block_counts()["free"] == 6


def steps(s, count: int, token: int = 5) -> list:
    """The shapes of ``count`` plans, each updated with ``token`` drawn by every sampling chunk."""
    shapes = []
    for _ in range(count):
        plan = s.schedule()
        shapes.append(plan_shape(plan))
        update(s, plan, {c.request.request_id: token for c in plan.chunks})
    return shapes


def test_shorter_prompts_pass_long_ones_and_a_long_prefill_beside_others_takes_a_quarter_step():
    s = make(num_blocks=32, budget=8, prefix_caching=False)  # the same prompts: nothing taken from a cache
    for rid, n in (("long1", 20), ("long2", 20), ("short", 3)):
        s.add(req(rid, n))
    # long1 has more than a step's budget to compute: it is long, and beside short 2 tokens a step;
    # long2 waits while long1 is long, and short passes it
    assert steps(s, 7) == [
        [("long1", 0, 2, False), ("short", 0, 3, True)],
        [("long1", 2, 2, False), ("short", 3, 1, True)],
        [("long1", 4, 2, False), ("short", 4, 1, True)],
        [("long1", 6, 2, False), ("short", 5, 1, True)],
        [("long1", 8, 2, False), ("short", 6, 1, True)],
        [("long1", 10, 2, False), ("short", 7, 1, True)],
        [("long1", 12, 8, True)],  # 8 tokens left: no longer long, and first in line for the step
    ]
    assert [r.request_id for r in s.waiting] == ["long2"]
    for rid in ("long1", "long2", "short"):
        s.abort(rid)
    s.check_integrity()
    assert s.block_counts()["free"] == 32


def test_alone_a_long_prefill_takes_the_whole_step():
    s = make(num_blocks=32, budget=8, prefix_caching=False)
    s.add(req("long1", 20))
    s.add(req("long2", 20))
    assert steps(s, 3) == [
        [("long1", 0, 8, False)],
        [("long1", 8, 8, False)],
        # long1 has 3 tokens left, so it is not long: beside it, long2 starts on 2
        [("long1", 16, 4, True), ("long2", 0, 2, False)],
    ]


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
    assert [(o.request_id, o.new_token_ids, o.finish_reason, o.block_ids) for o in outs] == [
        ("p", [9], "prefilled", [0, 1])
    ]
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
        ("a", 0, [10], False),
        ("a", 1, [11], False),
        ("a", 2, [12], False),
    ]
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
