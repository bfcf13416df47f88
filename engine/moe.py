"""Mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` experts per token (Qwen3-MoE,
Mixtral), computed grouped by expert.

The arithmetic is transformers' own, in its order, so float32 tokens equal it: the router's logits in
the model dtype, its softmax in float32, top-k, optionally renormalised; each expert takes its tokens
in the order transformers visits them (by top-k slot, then token) and adds its weighted output into
the result with one ``index_add_``, experts in ascending order. The loop is over the experts a step
hits, never over tokens.

Split over the ranks of a tensor-parallel engine (engine/tensor_parallel.py ``Shard``), either way the
rank's partial output is summed over the ranks by the layer's existing all-reduce::

    tensor parallel (expert_parallel_size 1)   every expert on every rank, its intermediate features split
    expert parallel (= tensor_parallel_size)   experts [r * E/N, (r+1) * E/N) on rank r, whole

The router is whole on every rank, so every rank picks the same experts for every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoESpec:
    """The experts of a model's config, as each family names them."""

    num_experts: int
    top_k: int
    intermediate: int  # features of one expert
    normalize: bool  # the top-k weights renormalised to sum to 1
    weights_in_model_dtype: bool
    layers: frozenset[int]  # the layers whose MLP is the experts (the others are dense)

    @classmethod
    def of(cls, cfg) -> MoESpec | None:
        """None for a dense model."""
        layers = range(cfg.num_hidden_layers)
        if cfg.model_type == "mixtral":
            return cls(
                cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, False, frozenset(layers)
            )
        if cfg.model_type == "qwen3_moe" and cfg.num_experts > 0:
            step, dense = cfg.decoder_sparse_step, set(cfg.mlp_only_layers or ())
            sparse = frozenset(i for i in layers if i not in dense and (i + 1) % step == 0)
            return cls(
                cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob, True, sparse
            )
        return None


class MoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        experts: range,
        weights_in_model_dtype: bool,
    ) -> None:
        """``intermediate``: each local expert's features (this rank's share); ``experts``: the global ids
        this rank holds; ``weights_in_model_dtype``: the routing weights are rounded to the model dtype
        before they scale an expert's output (Qwen3-MoE), or kept in float32 (Mixtral)."""
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.first_expert, self.intermediate = experts.start, intermediate
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(len(experts), hidden, intermediate)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each [tokens, top_k]."""
        logits = F.linear(x, self.gate.weight)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.weights_in_model_dtype else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        tokens = x.shape[0]
        # (expert, top-k slot, token) order: a stable sort of the slot-major flattening by expert id
        order = torch.argsort(ids.t().reshape(-1), stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        end = sum(counts[: self.first_expert])
        for local in range(self.experts.count):
            start, end = end, end + counts[self.first_expert + local]
            if start == end:
                continue
            picked = order[start:end]
            token, slot = picked % tokens, picked // tokens
            gate, up = F.linear(x[token], self.experts.gate_up_proj[local]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.down_proj[local])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class Experts(nn.Module):
    """One rank's experts' weights, stacked as transformers stacks them (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``): gate and up side by side per expert."""

    def __init__(self, count: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.count = count
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, intermediate))
