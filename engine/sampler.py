"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, log-probabilities.

A seeded request draws token i from a generator seeded with (seed, i), so the
same seed gives the same text whatever the batch, and whether the first token
was sampled on a prefill server and the rest on a decode server. The first
tokens of a request with ``n > 1`` are n draws from one row, draw j seeded
with ``seed + j``: exactly what n requests with seeds seed..seed+n-1 draw.

Each row is first processed (engine/logits_processing.py). Log-probabilities
are those of the processed row over the temperature (1 for temperature 0), before
top-k/top-p truncation: the distribution the token was drawn from. Rows that
ask for no processing and no log-probabilities cost what they always did.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.logits_processing import needs_processing, process_rows
from engine.request import LOGPROB_FLOOR, SAMPLING_EPS, Logprob, Request, SamplingParams

_SEED_STRIDE = 1_000_003


def sample(
    logits: torch.Tensor, requests: Sequence[Request], generator: torch.Generator, eos_token_ids: Sequence[int] = ()
) -> list[tuple[list[int], list[Logprob] | None]]:
    """Tokens (``request.draws_first_tokens`` of them) and, when asked, their
    log-probabilities for each row of float32 ``logits`` [rows, vocab], which
    are processed in place."""
    processed = [row for row, request in enumerate(requests) if needs_processing(request)]
    if len(processed) == len(requests):
        process_rows(logits, requests, eos_token_ids)
    elif processed:
        rows = logits[processed]
        process_rows(rows, [requests[r] for r in processed], eos_token_ids)
        logits[processed] = rows
    # max's indices are argmax's (the first of equal values, a NaN's where there is one) at a third of its
    # cost on CPU: 89 vs 267 us for 8 rows of a 49152-token vocabulary
    greedy = logits.max(dim=-1).indices.tolist()
    tokens: list[list[int]] = []
    for row, request in enumerate(requests):
        p, index = request.sampling, len(request.output_token_ids)
        draws = [greedy[row]] * request.draws_first_tokens
        if not p.greedy:
            draws = [
                _sample_row(logits[row], p, _generator(p, j, index, generator, logits.device))
                for j in range(len(draws))
            ]
        tokens.append(draws)
    logprobs = _logprobs(logits, requests, tokens)
    return [(t, logprobs.get(row)) for row, t in enumerate(tokens)]


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: Sequence[int]) -> list[Logprob]:
    """A Logprob per row of ``logprobs`` [rows, vocab]: ``chosen[r]``'s and the ``ks[r]`` most likely."""
    k = max(ks)
    picked = logprobs.gather(1, chosen[:, None])
    if k == 0:
        return [Logprob(v) for v in picked[:, 0].clamp(min=LOGPROB_FLOOR).tolist()]
    values, ids = logprobs.topk(k, dim=-1)
    # one copy to the host: [picked, k values, k ids] per row (ids are exact in float64)
    rows = torch.cat([picked, values], dim=1).clamp(min=LOGPROB_FLOOR).double()
    rows = torch.cat([rows, ids.double()], dim=1).tolist()
    return [
        Logprob(r[0], tuple((int(t), v) for t, v in zip(r[k + 1 : k + 1 + n], r[1 : 1 + n]))) for r, n in zip(rows, ks)
    ]


def _logprobs(logits: torch.Tensor, requests: Sequence[Request], tokens: list[list[int]]) -> dict[int, list[Logprob]]:
    rows = [r for r, request in enumerate(requests) if request.sampling.logprobs is not None]
    if not rows:
        return {}
    temperatures = [requests[r].sampling.temperature for r in rows]
    scale = torch.tensor([t if t >= SAMPLING_EPS else 1.0 for t in temperatures], device=logits.device)
    logprobs = torch.log_softmax(logits[rows] / scale[:, None], dim=-1)
    owner = [i for i, r in enumerate(rows) for _ in tokens[r]]  # one row of ``logprobs`` per draw
    chosen = torch.tensor([t for r in rows for t in tokens[r]], dtype=torch.long, device=logits.device)
    ks = [requests[rows[i]].sampling.logprobs for i in owner]
    flat = top_logprobs(logprobs[owner], chosen, ks)
    out: dict[int, list[Logprob]] = {}
    for i, lp in zip(owner, flat):
        out.setdefault(rows[i], []).append(lp)
    return out


def _generator(
    p: SamplingParams, draw: int, index: int, shared: torch.Generator, device: torch.device
) -> torch.Generator:
    if p.seed is None:
        return shared
    gen = torch.Generator(device=device)
    gen.manual_seed(((p.seed + draw) * _SEED_STRIDE + index) % (2**63))
    return gen


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
    if not bool(probs.isfinite().all()):  # every token masked, or a logit overflowed: argmax as greedy does
        return int(logits.argmax())
    return int(torch.multinomial(probs, 1, generator=generator).item())
