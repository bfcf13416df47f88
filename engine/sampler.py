"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws token i from a generator seeded with (seed, i), so the
same seed gives the same text whatever the batch, and whether the first token
was sampled on a prefill server and the rest on a decode server.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams

_SEED_STRIDE = 1_000_003


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
           generator: torch.Generator) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]; ``indices[r]`` is the output index being drawn."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, index) in enumerate(zip(params, indices)):
        if p.greedy:
            continue
        gen = generator
        if p.seed is not None:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed((p.seed * _SEED_STRIDE + index) % (2**63))
        tokens[row] = _sample_row(logits[row], p, gen)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    logits = logits.float() / p.temperature  # float32: half-precision logits over a small temperature overflow
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # and always the most likely token: a top_p that rounds to 0 in float32 would drop all
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
