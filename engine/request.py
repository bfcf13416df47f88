"""The request object: one place for a request's state; progress is a counter.

A request's tokens are ``prompt_token_ids + output_token_ids``. The engine has
computed KV for the first ``num_computed`` of them. Prefill and decode are not
phases: a request with ``num_computed < num_tokens - 1`` still has prompt (or
recomputed) tokens to process, one with ``num_computed == num_tokens - 1`` is
decoding. A request whose KV was written by a prefill server is admitted with
``num_computed == len(prompt)`` and its first token already in the output.

With prefix caching, ``num_computed`` starts past the blocks found in the
cache (``num_cached_tokens``); ``block_hashes`` are the chained hashes of the
request's full blocks, computed once from its tokens (engine/block_manager.py),
and the first ``num_hashed_blocks`` of its blocks are registered in the cache.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, replace


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    PREFILLED = "prefilled"  # prefill mode: first token sampled, blocks held for transfer
    FINISHED = "finished"


SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): dividing logits by them overflows
MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's limit)
LOGPROB_FLOOR = -9999.0  # what a log-probability of -inf is reported as (JSON has no infinity)


@dataclass(frozen=True)
class StructuredSpec:
    """A grammar the output must match: ``kind`` json_schema (``value`` the schema as JSON),
    regex, choice (``value`` a JSON list of strings) or lark (an llguidance Lark grammar)."""

    kind: str
    value: str


def kv_blocks_needed(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """The most KV blocks a request can hold at once if none of its ``n`` sequences stops
    early: the prompt's full blocks, shared by the sequences, and each sequence's own
    blocks from the prompt's partial last block to ``max_tokens`` past the prompt."""
    shared = num_prompt_tokens // block_size
    own = -(-(num_prompt_tokens + max_tokens) // block_size) - shared
    return shared + n * own


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` (or below ``SAMPLING_EPS``) means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # sequences sampled from one prompt; sequence i draws with seed + i
    logprobs: int | None = None  # per generated token: the chosen token's log-probability and this many top ones
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if not all(math.isfinite(b) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be finite numbers")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def for_sequence(self, index: int) -> SamplingParams:
        """The sampling of sequence ``index`` of a request: seeded with ``seed + index``."""
        return self if self.seed is None or index == 0 else replace(self, seed=self.seed + index)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability and the ``top`` (token id, log-probability) pairs of
    the distribution it was drawn from, most likely first (-inf reported as LOGPROB_FLOOR)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)  # identity: two sequences of one request may hold equal tokens
class Request:
    """One sequence. A request with ``sampling.n > 1`` becomes n sequences once its
    first tokens are drawn; they share ``request_id`` and differ in ``index``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)  # for the age of the blocks it holds
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when last admitted
    block_hashes: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    index: int = 0  # the sequence's index among the request's n
    grammar: object | None = None  # engine.structured.Grammar when sampling.structured is set, else None
    prompt_logprobs: list[Logprob | None] | None = None  # gathered chunk by chunk until the first output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The prompt's log-probabilities are still to be computed (and so the whole
        prompt: such a request never takes blocks from the prefix cache)."""
        return self.sampling.prompt_logprobs is not None and self.index == 0 and not self.output_token_ids

    @property
    def draws_first_tokens(self) -> int:
        """How many tokens the next sample draws: n for a request's first token, else 1."""
        return self.sampling.n if self.index == 0 and not self.output_token_ids else 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request.

    ``logprobs``: one entry per new token when the request asked for them.
    ``prompt_logprobs``: once, with the first token, when asked for: one entry
    per prompt token, None for the first (nothing precedes it).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    block_ids: list[int] | None = None
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    index: int = 0  # the sequence (0..n-1) of a request with ``sampling.n > 1``


@dataclass(frozen=True)
class ChunkResult:
    """What the runner computed for one chunk of a plan (engine/runner.py).

    ``token_ids``: the tokens sampled, when the chunk samples: one, or n for
    the first tokens of a request with ``sampling.n > 1`` (sequence i's at i).
    ``logprobs``: one per sampled token, when the request asks for them.
    ``prompt_logprobs``: the prompt entries this chunk's rows gave (None
    first for position 0), when the request asks for them.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None


class NoCapacityError(RuntimeError):
    """Not enough free KV blocks for a reservation right now; retry later or elsewhere."""
