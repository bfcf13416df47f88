"""A request with n > 1: n sequences from one prompt computed once, sharing its
full blocks by reference count, each with its own copy of the partial last one."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import Request
from engine.sequences import record_token
from tests.engine.oracle import hf_greedy
from tests.engine.remote_kv import copy_prompt_kv

PROMPT = [(11 * i) % 400 + 5 for i in range(37)]  # 4 full blocks of 8 and 5 tokens: block 4 is partial
SEEDED = dict(temperature=1.0, top_k=50, seed=21, ignore_eos=True)


def engine(path, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 8)
    return LLMEngine(EngineConfig(model=path, num_threads=1, **kw))


def collect(e: LLMEngine, got: dict | None = None, each_step=None) -> dict[tuple[str, int], list[int]]:
    """Steps to the end: every sequence's tokens by (request id, index); exactly one finished output each."""
    got = {} if got is None else got
    finished = set()
    while e.has_unfinished():
        for out in e.step():
            key = (out.request_id, out.index)
            assert key not in finished
            got.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(key)
        e.check_integrity()
        if each_step is not None:
            each_step()
    assert finished == set(got)
    return got


def refs(e: LLMEngine, ids) -> list[int]:
    return [e.scheduler.blocks.blocks[i].ref_count for i in ids]


def assert_all_free(e: LLMEngine) -> None:
    e.check_integrity()
    assert e.block_counts() == {"free": e.cache.num_blocks, "reserved": 0, "running": 0}
    assert e.scheduler.requests == {}


@pytest.mark.parametrize("path", ["tiny_model", "tiny_llama_model"])
def test_n4_greedy_gives_four_copies_of_the_transformers_output(request, path):
    model = request.getfixturevalue(path)
    e = engine(model)
    e.add_request("r", PROMPT, SamplingParams(n=4, max_tokens=8, temperature=0, ignore_eos=True))
    first = e.step()
    assert [(o.request_id, o.index, len(o.new_token_ids)) for o in first] == [("r", i, 1) for i in range(4)]
    seqs = e.scheduler.requests["r"]
    assert [s.index for s in seqs] == [0, 1, 2, 3]
    # the 4 full prompt blocks are shared; block 4 (tokens 32..36) is the parent's, 5, 6, 7 its copies
    assert [s.block_ids for s in seqs] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5], [0, 1, 2, 3, 6], [0, 1, 2, 3, 7]]
    assert refs(e, range(8)) == [4, 4, 4, 4, 1, 1, 1, 1]
    for copy in (5, 6, 7):
        assert torch.equal(e.cache.kv[:, :, copy], e.cache.kv[:, :, 4])
    e.check_integrity()
    got = collect(e, {("r", o.index): list(o.new_token_ids) for o in first})
    assert got == {("r", i): hf_greedy(model, PROMPT, 8, ignore_eos=True) for i in range(4)}
    assert_all_free(e)


def test_a_prompt_ending_on_a_block_boundary_is_shared_whole_and_nothing_is_copied(tiny_model):
    prompt = PROMPT[:32]  # 4 full blocks of 8
    e = engine(tiny_model, prefix_caching=False)
    e.add_request("r", prompt, SamplingParams(n=3, max_tokens=5, temperature=0, ignore_eos=True))
    first = e.step()
    assert [s.block_ids for s in e.scheduler.requests["r"]] == [[0, 1, 2, 3]] * 3
    assert refs(e, range(5)) == [3, 3, 3, 3, 0]
    second = e.step()  # each sequence's first decode opens a block of its own
    assert [s.block_ids for s in e.scheduler.requests["r"]] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5], [0, 1, 2, 3, 6]]
    e.check_integrity()
    got = {("r", o.index): list(o.new_token_ids) for o in first}
    for o in second:
        got["r", o.index] += o.new_token_ids
    got = collect(e, got)
    assert got == {("r", i): hf_greedy(tiny_model, prompt, 5, ignore_eos=True) for i in range(3)}
    assert_all_free(e)


def test_n4_seeded_is_reproducible_and_equals_four_requests_seeded_seed_plus_i(tiny_model):
    sampling = SamplingParams(n=4, max_tokens=10, **SEEDED)
    runs = []
    for budget in (2048, 16):  # the prompt in one step, then in chunks
        e = engine(tiny_model, max_num_batched_tokens=budget)
        e.add_request("r", PROMPT, sampling)
        e.add_request("other", PROMPT[:20], SamplingParams(max_tokens=6, temperature=0))
        runs.append(collect(e))
        assert_all_free(e)
    assert runs[0] == runs[1]
    one_by_one = engine(tiny_model)
    for i in range(4):
        one_by_one.add_request(str(i), PROMPT, SamplingParams(max_tokens=10, **{**SEEDED, "seed": 21 + i}))
    alone = collect(one_by_one)
    assert [runs[0]["r", i] for i in range(4)] == [alone[str(i), 0] for i in range(4)]
    assert len({tuple(runs[0]["r", i]) for i in range(4)}) == 4


def test_every_sequence_carries_its_own_logprobs_and_only_sequence_0_the_prompts(tiny_model):
    e = engine(tiny_model)
    e.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=4, logprobs=2, prompt_logprobs=1, **SEEDED))
    outputs = [o for _ in range(8) for o in e.step()]
    assert [len(o.logprobs) for o in outputs] == [1] * 12
    assert [o.index for o in outputs if o.prompt_logprobs is not None] == [0]
    assert len(outputs[0].prompt_logprobs) == len(PROMPT)
    assert_all_free(e)


def test_abort_midway_ends_every_sequence_and_frees_every_block(tiny_model):
    e = engine(tiny_model)
    e.add_request("r", PROMPT, SamplingParams(n=4, max_tokens=30, **SEEDED))
    e.add_request("keep", PROMPT[:9], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert len(e.scheduler.requests["r"]) == 4
    assert e.abort("r")
    e.check_integrity()
    assert "r" not in e.scheduler.requests
    got = collect(e)
    assert set(got) == {("keep", 0)}
    assert_all_free(e)


def test_max_tokens_1_ends_every_sequence_at_once(tiny_model):
    e = engine(tiny_model)
    e.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=1, temperature=0))
    outs = e.step()
    assert [(o.index, o.finished, o.finish_reason) for o in outs] == [(i, True, "length") for i in range(3)]
    assert_all_free(e)


def test_a_sequence_stopping_early_leaves_the_others_their_shared_blocks(tiny_model):
    free = engine(tiny_model)
    free.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=8, **SEEDED))
    unstopped = collect(free)
    stop = unstopped["r", 0][1]
    assert stop != unstopped["r", 0][0]
    want = {k: v[: v.index(stop) + 1] if stop in v else v for k, v in unstopped.items()}
    assert len(want["r", 0]) == 2 and max(len(v) for v in want.values()) > 3
    e = engine(tiny_model)
    e.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=8, stop_token_ids=(stop,), **SEEDED))
    shared_refs = []

    def look():
        seqs = e.scheduler.requests.get("r", [])
        shared_refs.append((len(seqs), refs(e, [0, 1, 2, 3]) if seqs else None))

    assert collect(e, each_step=look) == want
    # sequence 0 ends at its 2nd token; the other two keep the 4 full prompt blocks to the end
    steps = max(len(v) for v in want.values())
    assert shared_refs == [(3, [3] * 4)] + [(2, [2] * 4)] * (steps - 2) + [(0, None)]
    assert_all_free(e)


def test_preemption_and_forks_without_room_recompute_and_stay_exact(tiny_model):
    # 37 prompt tokens fill 5 of 7 blocks: the last fork gets no block for its copy and waits;
    # growing past the prompt then preempts sequences, which are recomputed
    e = engine(tiny_model, num_blocks=7, max_num_batched_tokens=64)
    e.add_request("r", PROMPT, SamplingParams(n=4, max_tokens=12, temperature=0, ignore_eos=True))
    e.step()
    seqs = e.scheduler.requests["r"]
    assert [len(s.block_ids) for s in seqs] == [5, 5, 5, 0]
    assert [s.status.value for s in seqs] == ["running", "running", "running", "waiting"]
    assert refs(e, range(7)) == [3, 3, 3, 3, 1, 1, 1]
    got = collect(e, {("r", i): [s.output_token_ids[0]] for i, s in enumerate(seqs)})
    assert e.counters.preemptions >= 1
    assert got == {("r", i): hf_greedy(tiny_model, PROMPT, 12, ignore_eos=True) for i in range(4)}
    assert_all_free(e)


def test_forks_beyond_max_num_seqs_wait_and_are_recomputed(tiny_model):
    e = engine(tiny_model, max_num_seqs=2)
    e.add_request("r", PROMPT, SamplingParams(n=4, max_tokens=6, temperature=0, ignore_eos=True))
    first = e.step()
    seqs = e.scheduler.requests["r"]
    assert [(s.status.value, len(s.block_ids)) for s in seqs] == [
        ("running", 5),
        ("running", 5),
        ("waiting", 0),
        ("waiting", 0),
    ]
    got = collect(e, {("r", o.index): list(o.new_token_ids) for o in first})
    assert got == {("r", i): hf_greedy(tiny_model, PROMPT, 6, ignore_eos=True) for i in range(4)}
    assert_all_free(e)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_prefill_engine_draws_n_first_tokens_and_a_decode_engine_continues_them_like_one_engine(tiny_model, layout):
    sampling = SamplingParams(n=4, max_tokens=8, logprobs=1, **SEEDED)
    colocated = engine(tiny_model)
    colocated.add_request("r", PROMPT, sampling)
    want = collect(colocated)
    prefill = engine(tiny_model, mode="prefill")
    decode = engine(tiny_model, block_size=16, mode="decode", kv_layout=layout)
    blocks = decode.reserve("r", PROMPT, sampling)
    assert blocks == [0, 1, 2]  # 38 tokens: prompt and first token
    prefill.add_request("r", PROMPT, sampling)
    (out,) = prefill.step()
    assert out.finish_reason == "prefilled"
    assert out.new_token_ids == [want["r", i][0] for i in range(4)] and len(out.logprobs) == 4
    copy_prompt_kv(prefill, out.block_ids, decode, blocks, len(PROMPT))
    prefill.release("r")
    assert_all_free(prefill)
    firsts = decode.admit_remote("r", out.new_token_ids)
    assert [(o.index, o.new_token_ids, o.logprobs) for o in firsts] == [
        (i, [t], None) for i, t in enumerate(out.new_token_ids)
    ]
    # blocks 0, 1 (tokens 0..31) shared; block 2 (tokens 32..36) copied into 3, 4, 5
    assert [s.block_ids for s in decode.scheduler.requests["r"]] == [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 5]]
    assert refs(decode, range(6)) == [4, 4, 1, 1, 1, 1]
    for copy in (3, 4, 5):
        assert torch.equal(decode.cache.kv[:, :, copy], decode.cache.kv[:, :, 2])
    got = collect(decode, {("r", o.index): list(o.new_token_ids) for o in firsts})
    assert got == want
    assert_all_free(decode)


def test_admit_remote_wants_one_first_token_per_sequence(tiny_model):
    decode = engine(tiny_model, mode="decode")
    decode.reserve("r", PROMPT, SamplingParams(n=2, max_tokens=4, temperature=0))
    with pytest.raises(ValueError, match="1 first tokens for a request of n=2"):
        decode.admit_remote("r", [5])
    decode.abort("r")
    assert_all_free(decode)


@pytest.mark.parametrize(
    "sampling,tokens,reasons",
    [
        (SamplingParams(max_tokens=3), [5, 6, 7], [None, None, "length"]),  # max_tokens
        (SamplingParams(max_tokens=9), [5, 2], [None, "stop"]),  # EOS
        (SamplingParams(max_tokens=9, ignore_eos=True), [2, 2], [None, None]),  # EOS ignored
        (SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=[7]), [2, 7], [None, "stop"]),  # a stop token
        (SamplingParams(max_tokens=9), [5, 6, 8], [None, None, "length"]),  # the context: 5 prompt + 3 = max_model_len
    ],
)
def test_a_sequence_stops_for_the_first_reason_its_token_gives(sampling, tokens, reasons):
    request = Request("r", [1, 1, 1, 1, 1], sampling)
    assert [record_token(request, t, eos_token_ids=(2,), max_model_len=8) for t in tokens] == reasons
    assert request.output_token_ids == tokens
