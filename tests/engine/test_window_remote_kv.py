"""A remote prompt's sliding-window layers need only the prompt's last ``window - 1`` tokens: a decode
engine given every layer's K/V of the rest only for its full-attention layers (its other slots full of
garbage) continues to transformers' tokens, and its prefix cache never offers a hit that would read the
garbage (the hit trimmed back to where every layer's K/V is held)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.make_model import TINY_SWA, make_tiny
from engine.request import Request
from tests.engine.oracle import hf_greedy

PROMPT = [(13 * i) % 300 + 7 for i in range(70)]
WINDOW = 8  # TINY_SWA's sliding layers: 0, 1 and 3 (layer 2 is global)


@pytest.fixture(scope="module")
def swa(tmp_path_factory) -> str:
    return str(make_tiny(tmp_path_factory.mktemp("tiny-swa"), TINY_SWA))


def copy_windowed(src: LLMEngine, src_blocks, dst: LLMEngine, dst_blocks, num_tokens: int, window_from: int):
    """Every layer's K/V of tokens [0, num_tokens), but a window layer's only from ``window_from`` on
    (source NHD, destination NHD); the destination's other slots hold large random values."""
    torch.manual_seed(0)
    dst.cache.kv.copy_(torch.randn_like(dst.cache.kv) * 100)
    sb, db = src.cache.block_size, dst.cache.block_size
    for layer, window in enumerate(src.layer_windows):
        for p in range(window_from if window is not None else 0, num_tokens):
            dst.cache.kv[layer, :, dst_blocks[p // db], p % db] = src.cache.kv[layer, :, src_blocks[p // sb], p % sb]


def remote_tokens(swa: str, prompt, window_from: int, decode: LLMEngine) -> list[int]:
    prefill = LLMEngine(EngineConfig(model=swa, block_size=16, num_blocks=16, num_threads=1, mode="prefill"))
    sampling = SamplingParams(max_tokens=12, temperature=0)
    blocks = decode.reserve("r", prompt, sampling)
    prefill.add_request("r", prompt, sampling)
    (out,) = prefill.step()
    copy_windowed(prefill, out.block_ids, decode, blocks, len(prompt), window_from)
    prefill.release("r")
    (first,) = decode.admit_remote("r", out.new_token_ids)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    decode.check_integrity()
    return tokens


def probe(prompt) -> Request:
    return Request("probe", list(prompt), SamplingParams())


def decode_engine(swa: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=swa, block_size=4, num_blocks=64, num_threads=1, mode="colocated"))


def test_the_engine_names_each_layer_s_window(swa):
    assert decode_engine(swa).layer_windows == (WINDOW, WINDOW, None, WINDOW)


def test_window_layers_need_the_prompt_s_last_window_minus_one_tokens_only(swa):
    first_read = len(PROMPT) - WINDOW + 1  # the first decode query (at len(PROMPT)) reads keys past len - window
    assert remote_tokens(swa, PROMPT, first_read, decode_engine(swa)) == hf_greedy(swa, PROMPT, 12)
    # one token fewer and the first decode reads garbage: the boundary above is exact
    assert remote_tokens(swa, PROMPT, first_read + 1, decode_engine(swa)) != hf_greedy(swa, PROMPT, 12)


def test_the_prefix_cache_offers_no_hit_over_window_kv_that_never_arrived(swa):
    decode = decode_engine(swa)
    answer = remote_tokens(swa, PROMPT, len(PROMPT) - WINDOW + 1, decode)
    assert answer == hf_greedy(swa, PROMPT, 12)
    # The prompt's blocks are cached, but a hit ending inside the prompt reads window K/V before 63.
    shorter = PROMPT[:40] + [5, 6, 7]
    assert len(decode.scheduler.blocks.match(decode.scheduler.prefix.hashes(probe(shorter), 10))) == 10
    assert decode.cached_prefix(shorter) == 0
    sampling = SamplingParams(max_tokens=6, temperature=0)
    assert decode.generate([shorter], sampling)[0].token_ids == hf_greedy(swa, shorter, 6)
    # A follow-up turn: positions 63.. hold every layer; 81 were computed (the last answer token was not
    # fed back), so the hit is 20 blocks of 4, its next query reading (72, 80).
    turn = PROMPT + answer + [9, 10, 11]
    assert decode.cached_prefix(turn) == 80
    assert decode.generate([turn], sampling)[0].token_ids == hf_greedy(swa, turn, 6)
    decode.check_integrity()
    assert decode.block_counts() == {"free": 64, "reserved": 0, "running": 0}
