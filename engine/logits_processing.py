"""Per-request changes to a row of logits before sampling, in this order (vLLM's):

1. ``logit_bias``: added to the named tokens' logits;
2. ``min_tokens``: until that many tokens were generated, the EOS ids (unless
   ``ignore_eos``) and ``stop_token_ids`` are set to -inf (not once the request's
   grammar allows nothing but EOS: a complete structured output ends);
3. ``repetition_penalty`` (Hugging Face's): over the prompt and output tokens,
   positive logits are divided by it, negative ones multiplied;
4. ``frequency_penalty`` / ``presence_penalty`` (OpenAI's): over the output
   tokens only, each token's logit loses ``frequency * count + presence``.

Rows of requests that ask for none of this are never touched (the sampler's
fast path). Greedy requests go through the same processing: their argmax is
over the processed logits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from engine.request import Request


def needs_processing(request: Request) -> bool:
    p = request.sampling
    return bool(
        p.logit_bias
        or p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
        or len(request.output_token_ids) < p.min_tokens
    )


def process_rows(logits: torch.Tensor, requests: Sequence[Request], eos_token_ids: Sequence[int]) -> None:
    """Applies each request's processing to its row of float32 ``logits`` [rows, vocab], in place.

    All rows at once, one gather/scatter per kind of processing: the cost per
    step hardly grows with the number of rows processed.
    """
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    banned: tuple[list[int], list[int], list[float]] = ([], [], [])
    seen: tuple[list[int], list[int], list[float]] = ([], [], [])
    counted: tuple[list[int], list[int], list[float]] = ([], [], [])
    for row, request in enumerate(requests):
        p, output = request.sampling, request.output_token_ids
        if p.logit_bias:
            _add(bias, row, [t for t, _ in p.logit_bias], [b for _, b in p.logit_bias])
        if len(output) < p.min_tokens and not (request.grammar is not None and request.grammar.finishing):
            ids = list(dict.fromkeys([*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]))
            _add(banned, row, ids, [0.0] * len(ids))
        if p.repetition_penalty != 1.0:
            ids = list(set(request.prompt_token_ids).union(output))
            _add(seen, row, ids, [p.repetition_penalty] * len(ids))
        if (p.frequency_penalty or p.presence_penalty) and output:
            counts = Counter(output)
            _add(counted, row, list(counts), [p.frequency_penalty * c + p.presence_penalty for c in counts.values()])
    device, dtype = logits.device, logits.dtype
    if bias[0]:
        logits.index_put_(_index(bias, device), torch.tensor(bias[2], dtype=dtype, device=device), accumulate=True)
    if banned[0]:
        logits[_index(banned, device)] = float("-inf")
    if seen[0]:
        index, penalty = _index(seen, device), torch.tensor(seen[2], dtype=dtype, device=device)
        values = logits[index]
        scaled = torch.where(values > 0, values / penalty, values * penalty)
        # A penalty beyond float32's range (0 or inf once converted) must not turn a masked -inf
        # into NaN (-inf * 0) nor a logit into +inf: either would be drawn against every mask.
        logits[index] = scaled.nan_to_num(nan=float("-inf"), posinf=torch.finfo(dtype).max)
    if counted[0]:
        index = _index(counted, device)
        logits.index_put_(index, -torch.tensor(counted[2], dtype=dtype, device=device), accumulate=True)


def _add(lists: tuple[list[int], list[int], list[float]], row: int, tokens: list[int], values: list[float]) -> None:
    lists[0].extend([row] * len(tokens))
    lists[1].extend(tokens)
    lists[2].extend(values)


def _index(lists, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(lists[0], dtype=torch.long, device=device),
        torch.tensor(lists[1], dtype=torch.long, device=device),
    )
