"""Paged attention as Triton kernels that read the KV cache in place through the block table.

The GPU path of ``engine.attention`` (``attention_backend``: engine/config.py): the same arithmetic as
its torch path, without the torch path's per-step gather of every row's context into padded tensors.
Tested on CPU under Triton's interpreter (``TRITON_INTERPRET=1``) against the torch path
(tests/engine/test_triton_attention.py); on CUDA it is compiled.

One kernel body serves both cache orders: a layer's K (or V) is addressed by three strides, so NHD
and HND differ only in the strides passed in::

    NHD  cache[block, slot, head, dim]   stride_block, stride_slot, stride_head = S*H*D, H*D, D
    HND  cache[block, head, slot, dim]   stride_block, stride_slot, stride_head = H*S*D, D, S*D

    token at position p of a row:  block_table[row, p // S], slot p % S

Decode (one query token per row) is split-K ("flash decoding"): a program takes one row, one KV head
with all the query heads that share it (grouped-query attention without repeating K/V), and one
split of the context; a second kernel merges the splits by their log-sum-exp. Prefill takes a tile
of one chunk's query tokens for one query head and walks the cached prefix and the chunk causally,
so a chunk that follows a cached prefix reads that prefix where it lies.

float32 products use IEEE float32 (``input_precision="ieee"``), not TF32, so float32 tokens equal
transformers on a GPU as they do on CPU. Sizes: ``tl.dot`` takes tiles of at least 16 in each
dimension on a GPU, so head groups and head dims are padded to 16 (masked).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.attention import PrefillBatch, cache_geometry

# Keys per inner step, query tokens per prefill tile, and the shortest context split worth a program
# of its own in a decode (shorter contexts run in fewer splits).
BLOCK_N = 32
BLOCK_M = 32
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _cache_strides(cache: torch.Tensor, hnd: bool) -> tuple[int, int, int]:
    """(block, slot, head) strides of one layer's K or V, [blocks, S, H, D] (NHD) or [blocks, H, S, D]."""
    assert cache.stride(-1) == 1, "the head dim is contiguous in every cache order"
    if hnd:
        return cache.stride(0), cache.stride(2), cache.stride(1)
    return cache.stride(0), cache.stride(1), cache.stride(2)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # the latter: the default, which other dtypes ignore


def _dot_in_float32(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bfloat16 tiles as their raw bits: under it (tests on CPU), bfloat16
    tiles are widened to float32 before ``tl.dot``. A GPU multiplies them as they are."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load_tile(K, V, table, pos, ok, kv_head, stride_kb, stride_ks, stride_kh, d, d_ok, BLOCK_SIZE: tl.constexpr):
    """One sequence's keys and values at positions ``pos`` (where ``ok``) for one KV head, [len(pos), dim],
    each found through ``table``, its row of the block table."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0)
    where = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    kv_ok = ok[:, None] & d_ok[None, :]
    k = tl.load(K + where[:, None] + d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + where[:, None] + d[None, :], mask=kv_ok, other=0.0)
    return k, v


@triton.jit
def _softmax_step(scores, v, m, total, acc, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Online softmax: one tile's scores (-inf where masked) and values into the running maximum ``m``,
    sum of weights ``total`` and weighted sum of values ``acc``."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet (outside its window)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, DOT_F32)
    return m_new, total * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    BlockTable,
    Lengths,
    MidO,
    MidLse,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    split_len,
    scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lengths + row)
    start = split * split_len
    end = tl.minimum(start + split_len, length)
    start = tl.maximum(start, tl.where(window > 0, length - window, 0))  # a sliding window: its last keys only

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :])

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        ok = pos < end
        k, v = _load_tile(
            K, V, BlockTable + row * stride_bt, pos, ok, kv_head, stride_kb, stride_ks, stride_kh, d, d_ok, BLOCK_SIZE
        )
        scores = tl.where(ok[None, :], _dot(q, tl.trans(k), PRECISION, DOT_F32) * scale, float("-inf"))
        m, total, acc = _softmax_step(scores, v, m, total, acc, PRECISION, DOT_F32)

    # An empty split (past the row's length) leaves total 0: its log-sum-exp is -inf, its weight 0.
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    mid = (row * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
    tl.store(MidO + mid[:, None] * BLOCK_D + d[None, :], out, mask=g_ok[:, None])
    tl.store(MidLse + mid, lse, mask=g_ok)


@triton.jit
def _decode_merge_kernel(
    MidO,
    MidLse,
    Out,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    mid = (row * tl.num_programs(1) + head) * NUM_SPLITS + s
    lse = tl.load(MidLse + mid)
    weight = tl.exp(lse - tl.max(lse, 0))
    parts = tl.load(MidO + mid[:, None] * BLOCK_D + d[None, :])
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(Out + row * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


def decode_splits(longest: int) -> tuple[int, int]:
    """(splits, tokens per split) of a decode whose contexts are at most ``longest`` tokens: one split per
    MIN_SPLIT_TOKENS, a power of two (the merge's tile), at most MAX_SPLITS."""
    splits = min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(longest, MIN_SPLIT_TOKENS)))
    return splits, triton.cdiv(triton.cdiv(longest, splits), BLOCK_N) * BLOCK_N


def decode_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hnd: bool,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over its paged context: q [rows, q_heads, dim], block_table
    [rows, max_blocks], lengths [rows] (this step's token included, already in the cache); ``window``:
    the last that many keys only (sliding-window attention). ``engine.native``'s decode kernel has the
    same signature without ``window``, so ``engine.attention`` calls either."""
    rows, q_heads, head_dim = q.shape
    block_size, kv_heads = cache_geometry(cache_k, hnd)
    group = q_heads // kv_heads
    # The padded table bounds every row's length without reading the lengths back from the device.
    splits, split_len = decode_splits(block_table.shape[1] * block_size)
    block_d = _pad(head_dim)
    mid_o = torch.empty((rows, q_heads, splits, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((rows, q_heads, splits), dtype=torch.float32, device=q.device)
    q = q.contiguous()
    stride_kb, stride_ks, stride_kh = _cache_strides(cache_k, hnd)
    assert _cache_strides(cache_v, hnd) == (stride_kb, stride_ks, stride_kh)
    _decode_split_kernel[(rows, kv_heads, splits)](
        q,
        cache_k,
        cache_v,
        block_table,
        lengths,
        mid_o,
        mid_lse,
        q.stride(0),
        q.stride(1),
        stride_kb,
        stride_ks,
        stride_kh,
        block_table.stride(0),
        split_len,
        scale,
        window or 0,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=splits,
        BLOCK_G=_pad(group),
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        PRECISION=_precision(q.dtype),
        DOT_F32=_dot_in_float32(q.dtype),
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(rows, q_heads)](
        mid_o,
        mid_lse,
        out,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=splits,
        BLOCK_D=block_d,
    )
    return out


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    Out,
    BlockTable,
    QueryStarts,
    QueryLens,
    ContextStarts,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    span = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    query_start = tl.load(QueryStarts + span)
    query_len = tl.load(QueryLens + span)
    context_start = tl.load(ContextStarts + span)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < query_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + (query_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    query_pos = context_start + rows  # each query token's position in its sequence
    # Causal: this tile's last query token sees every key up to its own position (0 keys past the chunk).
    keys_end = tl.where(tile * BLOCK_M < query_len, context_start + tl.minimum((tile + 1) * BLOCK_M, query_len), 0)

    # Sliding window: query position p sees keys (p - window, p]; this tile's first query the fewest.
    keys_start = tl.where(window > 0, tl.maximum(context_start + tile * BLOCK_M - window + 1, 0), 0)
    keys_start = keys_start // BLOCK_N * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for first in range(keys_start, keys_end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        ok = pos < keys_end
        k, v = _load_tile(
            K, V, BlockTable + span * stride_bt, pos, ok, kv_head, stride_kb, stride_ks, stride_kh, d, d_ok, BLOCK_SIZE
        )
        seen = ok[None, :] & (pos[None, :] <= query_pos[:, None])
        seen = seen & ((window <= 0) | (pos[None, :] > query_pos[:, None] - window))
        scores = tl.where(seen, _dot(q, tl.trans(k), PRECISION, DOT_F32) * scale, float("-inf"))
        m, total, acc = _softmax_step(scores, v, m, total, acc, PRECISION, DOT_F32)

    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        Out + (query_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    out: torch.Tensor,
    spans: PrefillBatch,
    scale: float,
    hnd: bool,
    window: int | None = None,
) -> None:
    """Causal attention of every prefill chunk of a step, written into ``out`` [tokens, q_heads, dim] at
    the chunks' rows. Each chunk's keys are its cached prefix and itself, read from the paged cache (this
    layer's K/V of the step are written before attention); ``window``: each query token sees only the
    last that many keys up to itself."""
    q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = cache_geometry(cache_k, hnd)
    stride_kb, stride_ks, stride_kh = _cache_strides(cache_k, hnd)
    grid = (spans.count, triton.cdiv(spans.max_query_len, BLOCK_M), q_heads)
    _prefill_kernel[grid](
        q,
        cache_k,
        cache_v,
        out,
        spans.block_table,
        spans.query_starts,
        spans.query_lens,
        spans.context_starts,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        stride_kb,
        stride_ks,
        stride_kh,
        spans.block_table.stride(0),
        scale,
        window or 0,
        GROUP=q_heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_D=_pad(head_dim),
        BLOCK_N=BLOCK_N,
        PRECISION=_precision(q.dtype),
        DOT_F32=_dot_in_float32(q.dtype),
    )
