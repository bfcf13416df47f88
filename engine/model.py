"""Llama / Qwen3 / Qwen2 decoder in plain torch, reading and writing a paged KV cache.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are
fused into one matmul each (``engine.loader`` concatenates them on load):
fewer, larger matmuls are markedly faster on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention, write_kv


class RMSNorm(nn.Module):
    """Same arithmetic as Hugging Face's: normalise in float32, scale in the model dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg, head_dim: int, qk_norm: bool, bias: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x, cos, sin, cache_layer, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        write_kv(cache_layer, k, v, meta)
        out = paged_attention(q, k, v, cache_layer, meta, self.scale)
        return self.o_proj(out.view(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, head_dim: int, qk_norm: bool, bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, head_dim, qk_norm, bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=getattr(cfg, "mlp_bias", False))

    def forward(self, x, cos, sin, cache_layer, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Decoder-only LM over a flattened batch of tokens from many requests."""

    def __init__(self, cfg, head_dim: int, qk_norm: bool, attention_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, head_dim, qk_norm, attention_bias) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Runs every layer; returns float32 logits for ``logits_rows`` only.

        ``on_layer(i)`` is called once layer i has run (its K/V are in the cache),
        so a prefill server can ship that layer while the next one computes.
        """
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv[i], meta)
            if on_layer is not None:
                on_layer(i)
        x = self.norm(x[logits_rows])
        return self.lm_head(x).float()
