"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over the paged cache, on plain torch ops.

A layer keeps one latent per token, shared by every head: ``c``, the KV compressed to ``kv_lora_rank``
values (after ``kv_a_layernorm``), and ``k_rope``, the decoupled RoPE key of ``qk_rope_head_dim`` values
(rotated). The engine's cache (engine/kv_cache.py) holds it as one KV head of half its width, its first
half in the K plane and its second in the V plane, so that a token costs exactly its latent and every
reader of (layer, K|V, block, slot, head), block copies and the transfer layer, moves latents unchanged::

    a token's latent, L = kv_lora_rank + qk_rope_head_dim values:
        | c: kv_lora_rank values ............................ | k_rope: qk_rope_head_dim |
        | K plane: latent[: L/2]            | V plane: latent[L/2 :]                       |

With ``kv_b_proj``'s weight per head as W_UK [qk_nope_head_dim, kv_lora_rank] (keys without RoPE) and
W_UV [v_head_dim, kv_lora_rank] (values):

- prefill chunks expand, as transformers does: each head's keys ``[c W_UK^T, k_rope]`` and values
  ``c W_UV^T`` for the chunk's whole context, then causal attention;
- decodes run absorbed: the query's part without RoPE is folded into latent space (``q_nope W_UK``), so
  a row attends with one head of width L over the context's latents as they are (multi-query attention
  with the latent as key and ``c`` as value), and W_UV is applied to the attention's output. A decode step
  never expands the context.

Under tensor parallelism a rank holds its query heads (their rows of ``q_b_proj`` and ``kv_b_proj``, its
columns of ``o_proj``) and the whole latent, computed and cached the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, _gather, write_kv


def latent_width(cfg) -> int | None:
    """Values of a token's latent (``kv_lora_rank + qk_rope_head_dim``) for an MLA model; None otherwise."""
    rank = getattr(cfg, "kv_lora_rank", None)
    return None if rank is None else int(rank) + int(cfg.qk_rope_head_dim)


def write_latent(cache_layer: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata) -> None:
    """Stores a step's new latents [tokens, L]: first halves in the K plane, second in the V plane."""
    half = latent.shape[-1] // 2
    write_kv(cache_layer, latent[:, None, :half], latent[:, None, half:], meta)


def _latents(cache_layer: torch.Tensor, table: torch.Tensor, hnd: bool) -> torch.Tensor:
    """The latents of blocks ``table`` [..., nblocks] as [..., 1, tokens, L]."""
    return torch.cat((_gather(cache_layer[0], table, hnd), _gather(cache_layer[1], table, hnd)), dim=-1)


def latent_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    kv_b_proj: Callable[[torch.Tensor], torch.Tensor],
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention output [tokens, heads, v_head_dim]. ``q_nope``, ``q_rope``: [tokens, heads, ...] (rotated);
    ``latent``: the step's new latents [tokens, L], already written; ``kv_b_proj``: c [n, kv_lora_rank] ->
    [n, heads * (qk_nope_head_dim + v_head_dim)], of weight ``kv_b_weight``."""
    tokens, heads, nope = q_nope.shape
    rank = kv_b_weight.shape[1]
    per_head = kv_b_weight.unflatten(0, (heads, -1))  # [heads, nope + v, rank]
    w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
    v_dim = w_uv.shape[1]
    out = q_nope.new_empty(tokens, heads, v_dim)
    for g in meta.decodes:
        rows = slice(g.start, g.start + g.count)
        # the torch path builds every decode group's padding mask (engine/runner.py, which gives MLA models
        # no attention kernel)
        assert g.mask is not None, "latent decodes need the runner's padding mask"
        absorbed = torch.bmm(q_nope[rows].transpose(0, 1), w_uk).transpose(0, 1)  # [count, heads, rank]
        query = torch.cat((absorbed, q_rope[rows]), dim=-1).unsqueeze(1)  # [count, 1, heads, L]
        context = _latents(cache_layer, g.block_table, meta.hnd)  # [count, 1, len, L]
        attn = F.scaled_dot_product_attention(query, context, context[..., :rank], attn_mask=g.mask, scale=scale)
        out[rows] = torch.bmm(attn[:, 0].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        total = span.context_start + span.query_len
        if span.context_start == 0:
            context = latent[rows]
        else:
            context = _latents(cache_layer, span.block_ids, meta.hnd)[0, :total]  # [total, L]
        kv = kv_b_proj(context[:, :rank].contiguous()).view(total, heads, -1)
        k_nope, values = kv.split([nope, v_dim], dim=-1)
        k_rope = context[:, None, rank:].expand(total, heads, -1)
        keys = torch.cat((k_nope, k_rope), dim=-1).transpose(0, 1).unsqueeze(0)  # [1, heads, total, qk]
        query = torch.cat((q_nope[rows], q_rope[rows]), dim=-1).transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        if span.context_start == 0:
            attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
        else:
            positions = torch.arange(total, device=q_nope.device)
            mask = positions[None, :] <= positions[span.context_start :, None]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
        out[rows] = attn[0].transpose(0, 1)
    return out
