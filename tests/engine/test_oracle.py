"""Greedy tokens from the engine equal transformers `generate`, exactly, with engine.native's decode
kernels (where this CPU runs them: decode attention, the decode layer, the projections of a few rows) and
with torch's alone (decode attention gathered and every projection torch's, as on CUDA and on CPUs
without engine.native)."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model import Linear
from tests.engine.oracle import hf_greedy

MAX_NEW = 10
# 1 token up to more than 3 blocks of 64
PROMPT_LENGTHS = [1, 2, 5, 17, 33, 64, 100, 203]


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["tiny_model", "tiny_llama_model"])
def model_and_reference(request):
    path = request.getfixturevalue(request.param)
    return path, [hf_greedy(path, p, MAX_NEW) for p in prompts()]


def test_reference_outputs_are_not_degenerate(model_and_reference):
    _, reference = model_and_reference
    assert all(len(r) >= 2 for r in reference)
    assert len({tuple(r) for r in reference}) == len(reference)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "oneshot"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "single"])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_greedy_tokens_equal_transformers(model_and_reference, block_size, chunked, batched, kv_layout, kernels):
    path, reference = model_and_reference
    engine = LLMEngine(
        EngineConfig(
            model=path,
            block_size=block_size,
            num_blocks=2048 // block_size + 64,
            max_num_batched_tokens=24 if chunked else 4096,
            chunked_prefill=chunked,
            num_threads=1,
            kv_layout=kv_layout,
            # torch: the path of CPUs without engine.native's kernels (no native decode attention, and so
            # no DecodeLayer), and of CUDA with attention_backend torch
            attention_backend="auto" if kernels == "native" else "torch",
        )
    )
    if kernels == "torch":
        for module in engine.runner.model.modules():
            if isinstance(module, Linear):
                module.few_rows = None  # torch's matmul for every row count (the packed copy from two rows)
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    if batched:
        got = [r.token_ids for r in engine.generate(prompts(), sampling)]
    else:
        got = [engine.generate([p], sampling)[0].token_ids for p in prompts()]
    assert got == reference
    engine.check_integrity()
    assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}
