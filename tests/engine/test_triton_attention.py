"""engine/triton_attention.py's kernels, run on CPU by Triton's interpreter: they compute what the torch
path of engine/attention.py computes, in every cache order, block size, head grouping, dtype and sliding
window, and an engine on them gives transformers' greedy tokens.

float32 agrees to a few units in the last place, not bit for bit: the kernels sum a row's keys in tiles
with a running maximum (online softmax), torch's scaled_dot_product_attention in its own order."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read by Triton when engine.triton_attention's kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine import triton_attention as ta  # noqa: E402
from engine.attention import AttentionMetadata, DecodeGroup, PrefillSpan, paged_attention  # noqa: E402
from engine.runner import attention_kernels  # noqa: E402
from tests.engine.oracle import hf_greedy  # noqa: E402

# Largest difference from the torch path, relative to the largest output: float32 a few ulps of the sums;
# half types their rounding of the probabilities before the product with V (as every flash kernel does).
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class Scenario:
    """A random paged cache and, for each row, a random set of distinct blocks holding ``lengths[i]``
    tokens; ``keys(i)`` / ``values(i)`` are row i's context in token order, [tokens, kv_heads, dim]."""

    def __init__(self, seed: int, lengths: list[int], block_size: int, kv_heads: int, head_dim: int, hnd: bool, dtype):
        self.block_size, self.hnd, self.kv_heads, self.head_dim = block_size, hnd, kv_heads, head_dim
        need = [-(-n // block_size) for n in lengths]
        num_blocks = sum(need) + 3
        inner = (kv_heads, block_size) if hnd else (block_size, kv_heads)
        gen = torch.Generator().manual_seed(seed)
        self.cache = torch.randn((2, num_blocks, *inner, head_dim), generator=gen).to(dtype)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, at = [], 0
        for n in need:
            self.tables.append(order[at : at + n])
            at += n

    def context(self, kv: int, row: int, length: int) -> torch.Tensor:
        blocks = self.cache[kv][torch.tensor(self.tables[row])]
        if self.hnd:  # [blocks, H, S, D] -> [tokens, H, D]
            blocks = blocks.transpose(1, 2)
        return blocks.reshape(-1, self.kv_heads, self.head_dim)[:length]

    def padded_table(self, rows: list[int]) -> torch.Tensor:
        width = max(len(self.tables[r]) for r in rows)
        return torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in rows])


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype] * max(scale, 1.0)


def torch_decode(s: Scenario, q: torch.Tensor, lengths: list[int], scale: float, window=None) -> torch.Tensor:
    rows = list(range(len(lengths)))
    table, lens = s.padded_table(rows), torch.tensor(lengths)
    span = torch.arange(table.shape[1] * s.block_size)
    mask = torch.zeros(len(rows), span.shape[0], dtype=q.dtype).masked_fill_(span[None] >= lens[:, None], -torch.inf)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decodes=len(rows),
        decodes=[DecodeGroup(0, len(rows), table, lens, mask[:, None, None, :])],
        prefills=[],
        hnd=s.hnd,
    )
    unused = torch.zeros(len(rows), s.kv_heads, s.head_dim, dtype=q.dtype)
    return paged_attention(q, unused, unused, s.cache, meta, scale, window)


windows = st.sampled_from([None, 1, 5, 40])  # sliding windows (None: full attention)
shapes = st.tuples(
    st.sampled_from([1, 2, 5, 16, 32]),  # block size
    st.sampled_from([(1, 1), (2, 3), (1, 8), (4, 2)]),  # (kv heads, query heads per KV head)
    st.sampled_from([16, 24, 64]),  # head dim (24: padded to 32 inside the kernel)
    st.booleans(),  # HND
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=shapes,
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    window=windows,
)
def test_decode_kernel_equals_the_torch_path(seed, shape, lengths, window):
    block_size, (kv_heads, group), head_dim, hnd, dtype = shape
    s = Scenario(seed, lengths, block_size, kv_heads, head_dim, hnd, dtype)
    gen = torch.Generator().manual_seed(len(lengths))
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    want = torch_decode(s, q, lengths, scale, window)
    table = s.padded_table(list(range(len(lengths))))
    got = ta.decode_attention(q, s.cache[0], s.cache[1], table, torch.tensor(lengths), scale, hnd, window)
    assert got.dtype == dtype and got.shape == q.shape
    assert_close(got, want, dtype)


def test_a_long_decode_splits_its_context_and_merges_the_splits():
    """A context past MIN_SPLIT_TOKENS runs in several programs, some of them past a short row's end: the
    merge equals one pass."""
    lengths = [5, ta.MIN_SPLIT_TOKENS * 3 + 7]
    s = Scenario(7, lengths, 16, 2, 32, False, torch.float32)
    table = s.padded_table([0, 1])
    assert ta.decode_splits(table.shape[1] * 16)[0] == 4
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    got = ta.decode_attention(q, s.cache[0], s.cache[1], table, torch.tensor(lengths), 32**-0.5, False)
    assert_close(got, torch_decode(s, q, lengths, 32**-0.5), torch.float32)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=shapes,
    chunks=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 70)), min_size=1, max_size=3),
    window=windows,
)
def test_prefill_kernel_equals_the_torch_path(seed, shape, chunks, window):
    """Chunks (cached prefix, new tokens): the kernel reads prefix and chunk from the cache, the torch path
    the prefix from the cache and a fresh chunk (no prefix) from the step's own K/V."""
    block_size, (kv_heads, group), head_dim, hnd, dtype = shape
    s = Scenario(seed, [start + n for start, n in chunks], block_size, kv_heads, head_dim, hnd, dtype)
    tokens = sum(n for _, n in chunks)
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.zeros(tokens, kv_heads, head_dim, dtype=dtype)
    v = torch.zeros_like(k)
    spans, rows, row = [], [], 0
    for i, (start, n) in enumerate(chunks):
        k[row : row + n] = s.context(0, i, start + n)[start:]
        v[row : row + n] = s.context(1, i, start + n)[start:]
        spans.append(PrefillSpan(row, n, start, torch.tensor(s.tables[i])))
        rows.append((row, n, start, s.tables[i]))
        row += n
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 0, [], spans, hnd=hnd)
    scale = head_dim**-0.5
    want = paged_attention(q, k, v, s.cache, meta, scale, window)
    width = max(len(t) for t in s.tables)
    batch = ta.PrefillBatch(
        query_starts=torch.tensor([r for r, *_ in rows]),
        query_lens=torch.tensor([n for _, n, *_ in rows]),
        context_starts=torch.tensor([c for _, _, c, _ in rows]),
        block_table=torch.tensor([t + [0] * (width - len(t)) for *_, t in rows]),
        max_query_len=max(n for _, n in chunks),
    )
    got = torch.full_like(q, float("nan"))
    ta.prefill_attention(q, s.cache[0], s.cache[1], got, batch, scale, hnd, window)
    assert_close(got, want, dtype)


def test_triton_on_a_cpu_outside_the_interpreter_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device, not 'cpu'"):
        attention_kernels("triton", torch.device("cpu"), torch.float32)
    assert attention_kernels("torch", torch.device("cpu"), torch.float32).name == "torch"
    assert attention_kernels("auto", torch.device("cpu"), torch.float16).name == "torch"


PROMPT_LENGTHS = [1, 5, 17, 40, 70]


@pytest.mark.parametrize(
    "model, kv_layout, block_size",
    [
        ("tiny_model", "NHD", 1),
        ("tiny_model", "HND", 16),
        ("tiny_llama_model", "NHD", 16),
        ("tiny_llama_model", "HND", 1),
    ],
)
def test_an_engine_on_triton_gives_transformers_greedy_tokens(request, model, kv_layout, block_size):
    """Batched prompts, chunked prefill (a budget of 24 tokens a step: chunks after a cached part) and a
    prompt that shares its first 32 tokens with an earlier one (a prefix-cache hit)."""
    path = request.getfixturevalue(model)
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in PROMPT_LENGTHS]
    shared = prompts[-1][:32] + [11, 12, 13]
    engine = LLMEngine(
        EngineConfig(
            model=path,
            block_size=block_size,
            num_blocks=512 // block_size + 32,
            max_num_batched_tokens=24,
            num_threads=1,
            kv_layout=kv_layout,
            attention_backend="triton",
        )
    )
    assert engine.runner.kernels.name == "triton"
    sampling = SamplingParams(max_tokens=8, temperature=0)
    got = [r.token_ids for r in engine.generate(prompts, sampling)]
    got.append(engine.generate([shared], sampling)[0].token_ids)
    assert got == [hf_greedy(path, p, 8) for p in [*prompts, shared]]
    engine.check_integrity()
    assert engine.block_counts() == {"free": engine.cache.num_blocks, "reserved": 0, "running": 0}
