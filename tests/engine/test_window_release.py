"""A model whose every layer slides (Mistral's window) releases a decoding sequence's blocks once every
layer's window has left them: the blocks held after each step are exactly those the window still reads
(and the one being written), the answers stay transformers', and every block is back at the end, with
prefix caching, several sequences of one prompt, preemption and a decode server's remote prompt. A model
with one full-attention layer releases nothing."""

from __future__ import annotations

import json

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.make_model import TinySpec, make_tiny
from tests.engine.oracle import hf_greedy

WINDOW, BS = 8, 4
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(30)]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return str(
        make_tiny(tmp_path_factory.mktemp("mistral-swa"), TinySpec(arch="mistral", seed=2, sliding_window=WINDOW))
    )


@pytest.fixture(scope="module")
def half_sliding(tmp_path_factory) -> str:
    """A tiny Qwen3 whose second layer slides and whose first attends over everything."""
    path = make_tiny(tmp_path_factory.mktemp("qwen3-swa"), TinySpec(arch="qwen3", seed=4))
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    config.pop("layer_types", None)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def engine_of(path: str, num_blocks: int = 64, **kw) -> LLMEngine:
    config = dict(model=path, block_size=BS, num_blocks=num_blocks, num_threads=1, attention_backend="torch")
    return LLMEngine(EngineConfig(**{**config, **kw}))


def held(num_computed: int) -> int:
    """Blocks a decoding sequence holds with ``num_computed`` tokens computed, once the blocks every
    layer's window left are released: those its next query (at ``num_computed``) reads, from
    num_computed - WINDOW + 1, up to its last computed token."""
    return -(-num_computed // BS) - max(num_computed - WINDOW + 1, 0) // BS


def run_one(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int, preempt_at: int | None = None):
    """Greedy tokens of one request, and (tokens computed, blocks held) after each step once its prompt
    was computed and the next step's release (what ``schedule`` does first) applied. ``preempt_at``: drop
    its blocks once it computed that many tokens; it is computed again from the start."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    tokens, seen = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        engine.check_integrity()
        (seq,) = engine.scheduler.requests.get(rid, [None])
        if seq is None or seq.num_computed < len(prompt):
            continue
        engine.scheduler._release_out_of_window(seq, WINDOW)
        seen.append((seq.num_computed, len(seq.held_block_ids)))
        if seq.num_computed == preempt_at:
            engine.scheduler._preempt(seq)
            engine.check_integrity()
    return tokens, seen


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_decoding_sequence_holds_only_what_its_window_reads(mistral, prefix_caching):
    engine = engine_of(mistral, prefix_caching=prefix_caching)
    tokens, seen = run_one(engine, "r", PROMPT, 40)
    assert tokens == hf_greedy(mistral, PROMPT, 40)
    assert [n for n, _ in seen] == list(range(len(PROMPT), len(PROMPT) + 39))  # the last step finishes it
    assert seen == [(n, held(n)) for n, _ in seen]
    assert max(h for _, h in seen) == 3  # the window's 8 tokens over blocks of 4, not the sequence's 70
    assert engine.block_counts() == {"free": 64, "reserved": 0, "running": 0}
    if prefix_caching:  # the released blocks stayed cached: the same prompt finds them again
        assert engine.cached_prefix(PROMPT, SamplingParams(max_tokens=1)) == (len(PROMPT) - 1) // BS * BS


def test_a_sequence_preempted_after_releasing_is_computed_again_to_the_same_answer(mistral):
    engine = engine_of(mistral)
    tokens, seen = run_one(engine, "r", PROMPT, 30, preempt_at=45)
    assert tokens == hf_greedy(mistral, PROMPT, 30)
    assert (45, held(45)) in seen and seen[-1] == (len(PROMPT) + 28, held(len(PROMPT) + 28))
    assert engine.block_counts() == {"free": 64, "reserved": 0, "running": 0}


def test_several_answers_run_together_where_their_whole_contexts_would_not_fit(mistral):
    # 20 blocks of 4; the three contexts (60, 50 and 42 tokens: 15, 13 and 11 blocks) fit one at a time
    engine = engine_of(mistral, num_blocks=20, max_num_batched_tokens=64)
    prompts = [PROMPT, [t + 1 for t in PROMPT[:20]], [t + 2 for t in PROMPT[:12]]]
    results = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert [r.token_ids for r in results] == [hf_greedy(mistral, p, 30) for p in prompts]
    assert engine.counters.preemptions == 0  # each holds its window's blocks, not its context's
    engine.check_integrity()
    assert engine.block_counts() == {"free": 20, "reserved": 0, "running": 0}


def test_sequences_of_one_prompt_share_its_blocks_and_release_their_own(mistral):
    engine = engine_of(mistral)
    sampling = SamplingParams(max_tokens=30, temperature=0.8, n=3, seed=5, ignore_eos=True)
    engine.add_request("n", PROMPT, sampling)
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()  # every reference counted: the shared prompt blocks too
    assert engine.block_counts() == {"free": 64, "reserved": 0, "running": 0}


def test_a_remote_prompt_releases_once_it_decodes(mistral):
    prefill, decode = engine_of(mistral, mode="prefill"), engine_of(mistral, mode="decode")
    sampling = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    dst = decode.reserve("r", PROMPT, sampling)
    prefill.add_request("r", PROMPT, sampling)
    (first,) = prefill.step()
    src = first.block_ids
    for s, d in zip(src, dst):  # the KV as a transfer places it (every layer slides)
        decode.cache.kv[:, :, d] = prefill.cache.kv[:, :, s]
    prefill.release("r")
    tokens = []
    for out in decode.admit_remote("r", first.new_token_ids):
        tokens += out.new_token_ids
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
        decode.check_integrity()
        (seq,) = decode.scheduler.requests.get("r", [None])
        if seq is not None:
            assert len(seq.held_block_ids) <= -(-WINDOW // BS) + 2
    assert tokens == hf_greedy(mistral, PROMPT, 20)
    assert decode.block_counts() == {"free": 64, "reserved": 0, "running": 0}


def test_one_full_attention_layer_keeps_every_block(half_sliding):
    engine = engine_of(half_sliding)
    assert engine.scheduler.config.release_window is None
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        (seq,) = engine.scheduler.requests.get("r", [None])
        if seq is not None:
            assert seq.released_blocks == 0 and len(seq.held_block_ids) == -(-seq.num_computed // BS)
