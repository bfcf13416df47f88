"""Paged attention over the KV cache, on plain torch ops (CPU and CUDA).

KV cache memory order, one tensor per engine (see ``engine.kv_cache``)::

    kv[layer, 0 = K | 1 = V, block, slot_in_block, kv_head, head_dim]   (NHD)
    kv[layer, 0 = K | 1 = V, block, kv_head, slot_in_block, head_dim]   (HND)

A token at position p of a request lives in block ``block_ids[p // block_size]``
at slot ``p % block_size``; its flat slot index is ``block * block_size + slot``.

A step's tokens are flattened into one batch: decode rows first (one query
token each), then prefill chunks. Every layer first writes the step's new K/V
through the slot mapping, then attends:

- decodes, on CPU where ``engine.native`` is built: its ``decode_attention``,
  which reads each row's context in place through its block table;
- decodes otherwise: K/V gathered by block table into [batch, kv_heads, len, dim]; the
  query heads are viewed as [batch, kv_heads, group, dim] so grouped-query
  attention is one batched matmul with no repeat_interleave. A batch is
  padded to its longest context, and the gather is memory-bound, so decodes
  are sorted by length and cut into groups (:func:`decode_groups`): short
  contexts do not read 2048 padded keys because one long one is running;
- prefill chunks: one causal attention per chunk over cached prefix + new
  tokens, so chunked prefill computes exactly what one-shot prefill does.

With the Triton backend (``attention_backend``, engine/config.py; the default
on CUDA) both run as engine/triton_attention.py's kernels instead, which read
every row's context in place through its block table: the decodes in one
launch (one group), the prefill chunks in another (:class:`PrefillBatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    query_start: int  # row of the chunk's first token in the flattened batch
    query_len: int
    context_start: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor  # blocks covering context_start + query_len tokens


@dataclass
class DecodeGroup:
    """Decode rows [start, start + count) of the batch, padded to one length."""

    start: int
    count: int
    block_table: torch.Tensor  # [count, max_blocks]
    lengths: torch.Tensor  # [count] context lengths, this step's token included
    mask: torch.Tensor | None  # [count, 1, 1, max_blocks * block_size], 0 = attend, -inf = padding (None: native)
    # a sliding window's mask per window, made by the first windowed layer of the step and kept for the others
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, block_size: int, window: int, dtype: torch.dtype) -> torch.Tensor:
        """[count, 1, 1, max_blocks * block_size], -inf past each row's length and before its last ``window``
        keys."""
        if window not in self.window_masks:
            span = torch.arange(self.block_table.shape[1] * block_size, device=self.lengths.device)
            lengths = self.lengths[:, None]
            mask = torch.zeros((self.count, span.shape[0]), dtype=dtype, device=lengths.device)
            mask.masked_fill_((span[None, :] >= lengths) | (span[None, :] < lengths - window), -torch.inf)
            self.window_masks[window] = mask[:, None, None, :]
        return self.window_masks[window]


@dataclass
class PrefillBatch:
    """Every prefill chunk of a step, as tensors a kernel reads (engine/triton_attention.py)."""

    query_starts: torch.Tensor  # [chunks] row of each chunk's first token
    query_lens: torch.Tensor  # [chunks]
    context_starts: torch.Tensor  # [chunks] tokens already cached before each chunk
    block_table: torch.Tensor  # [chunks, max_blocks] each chunk's blocks, padded with 0
    max_query_len: int

    @property
    def count(self) -> int:
        return self.query_lens.shape[0]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat slot per token
    num_decodes: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    hnd: bool = False  # the cache's memory order inside a block
    # reads each row's context in place through its block table: engine.native's decode_attention (CPU),
    # or engine/triton_attention.py's
    decode_kernel: Callable | None = None
    fused_decode: bool = False  # decode_kernel is engine.native's: its DecodeLayer may run a decode step whole
    decode_windows: bool = False  # decode_kernel takes a sliding window (Triton's); else windowed layers use torch's
    # engine/triton_attention.py's prefill_attention over ``prefill_batch``; None: one torch call per chunk
    prefill_kernel: Callable | None = None
    prefill_batch: PrefillBatch | None = None
    # The window layers' own, when they keep their blocks apart (engine/window_pool.py); None: they use this
    window: AttentionMetadata | None = None


# A decode starts a new group when its context is both twice the group's
# shortest and this many tokens longer: below that, one more gather and
# attention call per layer costs more than the padding it saves.
GROUP_MIN_EXTRA = 256


def decode_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """(start, count) runs of ``lengths`` (sorted ascending) padded together."""
    groups: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or (lengths[i] > 2 * lengths[first] and lengths[i] - lengths[first] > GROUP_MIN_EXTRA):
            groups.append((first, i - first))
            first = i
    return groups


def write_kv(cache_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store a step's new keys and values into one layer's blocks."""
    heads, dim = k.shape[1], k.shape[2]
    if meta.hnd:
        block_size = cache_layer.shape[3]
        blocks, slots = meta.slot_mapping // block_size, meta.slot_mapping % block_size
        cache_layer[0][blocks, :, slots] = k
        cache_layer[1][blocks, :, slots] = v
        return
    cache_layer[0].view(-1, heads, dim).index_copy_(0, meta.slot_mapping, k)
    cache_layer[1].view(-1, heads, dim).index_copy_(0, meta.slot_mapping, v)


def _gather(cache: torch.Tensor, table: torch.Tensor, hnd: bool) -> torch.Tensor:
    """Blocks ``table`` [..., nblocks] of one layer's K or V as [..., heads, tokens, dim]."""
    # index_select rather than cache[table]: advanced indexing splits even a tiny
    # gather across threads, which stalls for milliseconds on a busy CPU.
    blocks = cache.index_select(0, table.reshape(-1)).view(*table.shape, *cache.shape[1:])
    # blocks: [..., nblocks, S, H, D] (NHD) or [..., nblocks, H, S, D] (HND)
    lead = blocks.dim() - 4
    if hnd:
        return blocks.movedim(lead + 1, lead).flatten(lead + 1, lead + 2)
    return blocks.flatten(lead, lead + 1).transpose(lead, lead + 1)


def cache_geometry(cache: torch.Tensor, hnd: bool) -> tuple[int, int]:
    """(block size, KV heads) of one layer's K or V: [blocks, S, H, D] (NHD) or [blocks, H, S, D] (HND)."""
    return (cache.shape[2], cache.shape[1]) if hnd else (cache.shape[1], cache.shape[2])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [tokens, q_heads, dim]; k, v: the step's new [tokens, kv_heads, dim]. ``window``: sliding-window
    attention, each query token seeing only the last ``window`` keys up to itself (Mistral's, Gemma's)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    cache_k, cache_v = cache_layer[0], cache_layer[1]
    block_size, _ = cache_geometry(cache_k, meta.hnd)
    windowed = {} if window is None else {"window": window}
    for g in meta.decodes:
        rows = slice(g.start, g.start + g.count)
        if meta.decode_kernel is not None and (window is None or meta.decode_windows):
            out[rows] = meta.decode_kernel(
                q[rows], cache_k, cache_v, g.block_table, g.lengths, scale, meta.hnd, **windowed
            )
            continue
        keys = _gather(cache_k, g.block_table, meta.hnd)  # [count, kv_heads, len, dim]
        values = _gather(cache_v, g.block_table, meta.hnd)
        query = q[rows].view(g.count, num_kv_heads, group, head_dim)
        mask = g.mask if window is None else g.window_mask(block_size, window, q.dtype)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
        out[rows] = attn.reshape(g.count, -1, head_dim)
    if meta.prefill_kernel is not None and meta.prefill_batch is not None:
        meta.prefill_kernel(q, cache_k, cache_v, out, meta.prefill_batch, scale, meta.hnd, **windowed)
        return out
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, q_heads, len, dim]
        if span.context_start == 0 and window is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            total = span.context_start + span.query_len
            if span.context_start == 0:
                keys, values = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
            else:
                keys = _gather(cache_k, span.block_ids, meta.hnd)[:, :total].unsqueeze(0)
                values = _gather(cache_v, span.block_ids, meta.hnd)[:, :total].unsqueeze(0)
            positions = torch.arange(total, device=q.device)
            queries = positions[span.context_start :, None]
            mask = positions[None, :] <= queries
            if window is not None:
                mask &= positions[None, :] > queries - window
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = attn[0].transpose(0, 1)
    return out
