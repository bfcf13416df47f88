"""engine/decode_graphs.py's padded decode steps (what a CUDA graph replays), run eagerly on CPU with
Triton's kernels under its interpreter: the tokens equal transformers' whatever the padding, no other
request's block is written, and the settings that cannot work are refused at start."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read by Triton when engine.triton_attention's kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.decode_graphs import DecodeGraphs  # noqa: E402
from tests.engine.oracle import hf_greedy  # noqa: E402


def engine_on(path: str, backend: str = "triton", max_num_seqs: int = 8, **knobs) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=path,
            block_size=16,
            num_blocks=96,
            max_num_seqs=max_num_seqs,
            max_model_len=256,
            num_threads=1,
            attention_backend=backend,
            **knobs,
        )
    )


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_padded_decode_steps_give_transformers_greedy_tokens(tiny_model, kv_layout):
    """Five prompts of different lengths finish at different steps (max_tokens differ), so the decode
    steps run 5, 4, 3, 2 and 1 rows: buckets 8, 4, 4, 2 and 1, padded with copies of the last row."""
    engine = engine_on(tiny_model, kv_layout=kv_layout)
    engine.runner.use_decode_graphs(256, 8, capture=False)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    prompts = [[(5 * i + n) % 500 + 3 for i in range(n)] for n in (3, 20, 33, 9, 50)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4 + 2 * i, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    want = [hf_greedy(tiny_model, p, 4 + 2 * i, ignore_eos=True) for i, p in enumerate(prompts)]
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    assert graphs.replays == 4 + 2 * (len(prompts) - 1) - 1  # every step after the one of the prompts
    engine.check_integrity()
    assert engine.block_counts() == {"free": 96, "reserved": 0, "running": 0}


def test_padding_rows_write_only_the_last_rows_slot(tiny_model):
    """A step of 3 rows in a bucket of 4: the cache differs from before the step only in the 3 rows'
    slots, and the padding row's logits are not returned."""
    engine = engine_on(tiny_model)
    engine.runner.use_decode_graphs(256, 4, capture=False)
    graphs = engine.runner.graphs
    assert graphs is not None
    for i, n in enumerate((4, 7, 12)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # the prompts
    before = engine.cache.kv.clone()
    requests = sorted(engine.scheduler.running, key=lambda r: r.num_computed)
    slots = [r.block_ids[r.num_computed // 16] * 16 + r.num_computed % 16 for r in requests]
    replays = graphs.replays
    outputs = engine.step()
    assert graphs.replays == replays + 1 and len(outputs) == 3
    flat = (engine.cache.kv != before).reshape(*engine.cache.kv.shape[:2], -1, engine.cache.kv.shape[-2:].numel())
    changed_blocks_slots = flat.any(dim=(0, 1, 3)).nonzero().flatten().tolist()
    assert changed_blocks_slots == sorted(slots)


def test_cuda_graphs_are_refused_where_they_cannot_run(tiny_model):
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device, not 'cpu'"):
        engine_on(tiny_model, cuda_graphs=True)
    engine = engine_on(tiny_model, backend="torch")
    with pytest.raises(ValueError, match="cuda_graphs needs a decode kernel that reads the cache in place"):
        engine.runner.use_decode_graphs(256, 8, capture=False)


def test_buckets_stop_at_max_num_seqs():
    kv = torch.zeros(1, 2, 4, 16, 1, 8)
    table = torch.zeros(512, 8)

    def graphs(max_num_seqs: int) -> list[int]:
        return DecodeGraphs(None, kv, table, table, print, True, False, 16, 64, max_num_seqs, capture=False).buckets

    assert graphs(1) == [1]
    assert graphs(6) == [1, 2, 4, 6]
    assert graphs(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graphs(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
