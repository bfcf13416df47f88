"""Per-request changes to a row of logits before sampling, in this order (vLLM's):

1. ``logit_bias``: added to the named tokens' logits;
2. ``min_tokens``: until that many tokens were generated, the EOS ids (unless
   ``ignore_eos``) and ``stop_token_ids`` are set to -inf;
3. ``repetition_penalty`` (Hugging Face's): over the prompt and output tokens,
   positive logits are divided by it, negative ones multiplied;
4. ``frequency_penalty`` / ``presence_penalty`` (OpenAI's): over the output
   tokens only, each token's logit loses ``frequency * count + presence``.

Rows of requests that ask for none of this are never touched (the sampler's
fast path). Greedy requests go through the same processing: their argmax is
over the processed logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request


def needs_processing(request: Request) -> bool:
    p = request.sampling
    return bool(
        p.logit_bias or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        or len(request.output_token_ids) < p.min_tokens
    )


def process_row(row: torch.Tensor, request: Request, eos_token_ids: Sequence[int]) -> None:
    """Applies the request's processing to its float32 logits ``row`` [vocab], in place."""
    p, output, device = request.sampling, request.output_token_ids, row.device
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=device)
        row.index_put_((ids,), bias, accumulate=True)
    if len(output) < p.min_tokens:
        banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(request.prompt_token_ids + output, dtype=torch.long, device=device).unique()
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output:
        ids, counts = torch.tensor(output, dtype=torch.long, device=device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
