"""Mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` experts per token (Qwen3-MoE,
Mixtral, DeepSeek-V3), computed grouped by expert.

The arithmetic is transformers' own, in its order, so float32 tokens equal it: the router's logits in
the model dtype, its softmax in float32, top-k, optionally renormalised (DeepSeek-V3's router instead:
:class:`GroupLimitedGate`, all in float32; and its shared experts added to the routed ones, a dense MLP
whose features are split over tensor-parallel ranks as a dense layer's are); each expert takes its tokens
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
    routing: GroupLimited | None = None  # DeepSeek-V3's router; None: softmax over every expert
    shared_intermediate: int = 0  # features of the shared experts' MLP (DeepSeek's), 0: none

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
        if cfg.model_type == "deepseek_v3" and cfg.n_routed_experts:
            return cls(
                cfg.n_routed_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.norm_topk_prob,
                False,
                frozenset(range(cfg.first_k_dense_replace, cfg.num_hidden_layers)),
                GroupLimited(cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor),
                cfg.moe_intermediate_size * cfg.n_shared_experts,
            )
        return None


@dataclass(frozen=True)
class GroupLimited:
    """DeepSeek-V3's routing: experts in ``groups`` equal groups, a token's experts drawn from its best
    ``topk_groups`` groups only, their weights scaled by ``scaling`` (``routed_scaling_factor``)."""

    groups: int
    topk_groups: int
    scaling: float


class GroupLimitedGate(nn.Module):
    """DeepSeek-V3's router, transformers' ``DeepseekV3TopkRouter`` step for step, in float32 (its weight and
    ``e_score_correction_bias`` stay float32 in any model dtype): sigmoid scores; the bias added only to
    choose experts; a group's score the sum of its best two; top-k over the best groups' experts; the
    chosen experts' unbiased scores, renormalised if ``normalize``, times ``scaling``."""

    def __init__(self, hidden: int, num_experts: int, routing: GroupLimited) -> None:
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))

    def route(self, x: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        groups, experts = self.routing.groups, self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=self.routing.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best, 1)
        allowed = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
        choice = choice.masked_fill(~allowed.bool(), float("-inf"))
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routing.scaling, ids


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
        routing: GroupLimited | None = None,
        shared: nn.Module | None = None,
    ) -> None:
        """``intermediate``: each local expert's features (this rank's share); ``experts``: the global ids
        this rank holds; ``weights_in_model_dtype``: the routing weights are rounded to the model dtype
        before they scale an expert's output (Qwen3-MoE), or kept in float32 (Mixtral, DeepSeek-V3);
        ``routing``: DeepSeek-V3's router (:class:`GroupLimitedGate`); ``shared``: the shared experts, an
        MLP every token goes through, added to the routed experts' output."""
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.first_expert, self.intermediate = experts.start, intermediate
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate: nn.Linear | GroupLimitedGate
        if routing is None:
            self.gate = nn.Linear(hidden, num_experts, bias=False)
        else:
            self.gate = GroupLimitedGate(hidden, num_experts, routing)
        self.experts = Experts(len(experts), hidden, intermediate)
        self.shared_experts = shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each [tokens, top_k]."""
        if isinstance(self.gate, GroupLimitedGate):
            return self.gate.route(x, self.top_k, self.normalize)
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
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Experts(nn.Module):
    """One rank's experts' weights, stacked as transformers stacks them (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``): gate and up side by side per expert."""

    def __init__(self, count: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.count = count
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, intermediate))
