"""Before sampling: tokens a request's grammar disallows get logit -inf (engine/structured.py).

The masks of all grammar rows of a step are computed in one call on the
llguidance executor's threads, as a bitmask (bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed) in CPU memory, then moved to the
logits' device and applied there.
"""

from __future__ import annotations

import torch

from engine.structured import Grammar


def apply_grammar_masks(logits: torch.Tensor, grammars: list[Grammar | None]) -> None:
    """In place: row ``r`` of ``logits`` [rows, vocab] keeps only the tokens ``grammars[r]`` allows."""
    rows = [r for r, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    owner = grammars[rows[0]].owner
    words = -(-owner.vocab_size // 32)
    bits = torch.empty((len(rows), words), dtype=torch.int32)
    owner.executor.unsafe_compute_mask_ptr(
        [(grammars[r].matcher, i) for i, r in enumerate(rows)], bits.data_ptr(), words * 4, len(rows)
    )
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.to(logits.device).unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
