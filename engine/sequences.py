"""The sequences of a request with ``sampling.n > 1`` (pure Python).

Sequence 0 is the request as it arrived. Once its prompt is computed and its
n first tokens drawn, sequence i (1..n-1) is a new ``Request`` with the same
id, prompt and arrival time, ``index`` i, sampling seeded ``seed + i`` (so
it draws what a request with n=1 and that seed draws) and a fork of the
grammar matcher, if any. The scheduler gives it its blocks
(engine/scheduler.py).
"""

from __future__ import annotations

from engine.request import Request


def fork_sequence(parent: Request, index: int) -> Request:
    """Sequence ``index`` of ``parent``'s request, its output still empty and no blocks held."""
    return Request(
        parent.request_id,
        parent.prompt_token_ids,
        parent.sampling.for_sequence(index),
        arrival_time=parent.arrival_time,
        cache_salt=parent.cache_salt,
        index=index,
        grammar=None if parent.grammar is None else parent.grammar.fork(),
    )
