"""A request's sequences: when one stops, and the forks of a request with ``sampling.n > 1`` (pure Python).

``record_token`` appends a drawn token to a sequence and says whether it ends
there (EOS, a stop token, a complete grammar, ``max_tokens``, the context).

Sequence 0 is the request as it arrived. Once its prompt is computed and its
n first tokens drawn, sequence i (1..n-1) is a new ``Request`` with the same
id, prompt and arrival time, ``index`` i, sampling seeded ``seed + i`` (so
it draws what a request with n=1 and that seed draws) and a fork of the
grammar matcher, if any. The scheduler gives it its blocks
(engine/scheduler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from engine.request import FinishReason, Request

log = logging.getLogger(__name__)


def record_token(
    request: Request, token: int, eos_token_ids: Collection[int], max_model_len: int
) -> FinishReason | None:
    """Append ``token`` to a sequence's output and feed it to its grammar; return why the
    sequence stops there, if it does ("grammar": its grammar could not take it)."""
    request.output_token_ids.append(token)
    if request.grammar is not None and not request.grammar.accept(token):
        # The token obeyed the mask (sampled under it, or a remote first token checked by
        # remote_token_problem), so the matcher itself gave up: a grammar too ambiguous, or one
        # forcing unbounded text, hits llguidance's limits ("parser too complex"), or a grammar
        # matching no text left no token at all. The client's grammar, not a fault here: the
        # sequence ends, nothing invalid is emitted, and the router answers 400.
        log.info("request %s: its grammar cannot take token %d: %s", request.request_id, token, request.grammar.error())
        return "grammar"
    sampling = request.sampling
    if not sampling.ignore_eos and token in eos_token_ids:
        return "stop"
    if token in sampling.stop_token_ids:
        return "stop"
    if request.grammar is not None and request.grammar.done:
        return "stop"  # the grammar accepted EOS: complete, even with ignore_eos
    if len(request.output_token_ids) >= sampling.max_tokens:
        return "length"
    if request.num_tokens >= max_model_len:
        return "length"
    return None


def fork_sequence(parent: Request, index: int) -> Request:
    """Sequence ``index`` of ``parent``'s request, its output still empty and no blocks held."""
    return Request(
        parent.request_id,
        parent.prompt_token_ids,
        parent.sampling.for_sequence(index),
        arrival_time=parent.arrival_time,
        cache_salt=parent.cache_salt,
        tenant=parent.tenant,
        index=index,
        grammar=None if parent.grammar is None else parent.grammar.fork(),
    )
