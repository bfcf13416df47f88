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
import time
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as checked_dataclass


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    PREFILLED = "prefilled"  # prefill mode: first token sampled, blocks held for transfer
    FINISHED = "finished"


# Why a sequence ended: EOS, a stop token or a complete grammar ("stop"); max_tokens or the context
# ("length"); an abort; a token its grammar cannot take ("grammar"); on a prefill server, its prompt
# computed and its first token drawn ("prefilled": its blocks wait for the transfer).
FinishReason = Literal["stop", "length", "abort", "grammar", "prefilled"]

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): dividing logits by them overflows
LOGPROB_FLOOR = -9999.0  # what a log-probability of -inf is reported as (JSON has no infinity)

# What one request may ask for, and its bounds: written once here, checked when a ``SamplingParams`` is
# made (by the router from an OpenAI request, by a server from the router's JSON, by any engine caller).
# Every number is finite and ranged, so no caller hands the engine a value it cannot hold.
MAX_TOKENS = 1 << 24  # far above any context a pdserve engine holds
MAX_N = 16  # sequences per request
MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 1024
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
# Who a request is for: a configured tenant's name (router.tenants in deploy/config.py), checked wherever one
# arrives. It names the share of the shared KV store its blocks count against (engine/tiers/redis_store.py),
# goes into metric labels and store key names, and so is short and plain: lowercase letters, digits, '-'.
TENANT_NAME = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
DEFAULT_TENANT = "default"  # every key no tenant lists, and every request when no API keys are configured
_CHECKED = ConfigDict(extra="forbid", allow_inf_nan=False)


@checked_dataclass(frozen=True, config=_CHECKED)
class StructuredSpec:
    """A grammar the output must match: ``kind`` json_schema (``value`` the schema as JSON),
    regex, choice (``value`` a JSON list of strings) or lark (an llguidance Lark grammar)."""

    kind: Literal["json_schema", "regex", "choice", "lark"]
    value: str = Field(max_length=1 << 20)


def window_start(position: int, window: int) -> int:
    """The first key a query at ``position`` reads in a layer with a sliding ``window``: it sees keys
    (position - window, position], as transformers masks them."""
    return max(position - window + 1, 0)


def kv_blocks_needed(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """The most KV blocks a request can hold at once if none of its ``n`` sequences stops
    early: the prompt's full blocks, shared by the sequences, and each sequence's own
    blocks from the prompt's partial last block to ``max_tokens`` past the prompt."""
    shared = num_prompt_tokens // block_size
    own = -(-(num_prompt_tokens + max_tokens) // block_size) - shared
    return shared + n * own


@checked_dataclass(frozen=True, config=_CHECKED)
class SamplingParams:
    """Per-request sampling, as the engine runs it and as it travels from the router to the servers
    (JSON). ``temperature == 0`` (or below ``SAMPLING_EPS``) means greedy."""

    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1 << 24)  # 0 = off
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop_token_ids: tuple[TokenId, ...] = Field(default=(), max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)  # sequences sampled from one prompt; sequence i draws with seed + i
    # Per generated token: the chosen token's log-probability and this many top ones.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the same for prompt tokens but the first
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    # (token id, bias added to its logit)
    logit_bias: tuple[tuple[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]], ...] = Field(
        default=(), max_length=1 << 16
    )
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)  # EOS and stop_token_ids masked until this many tokens
    structured: StructuredSpec | None = None

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
    # The first this many of block_ids fell out of every layer's sliding window and were released: their
    # ids stay as placeholders, which attention masks (engine/scheduler.py ``_release_out_of_window``).
    released_blocks: int = 0
    # Where window layers keep their K/V apart from the full-attention layers' (engine/window_pool.py): the
    # window layers' block table, its first ``window_released`` entries placeholders for blocks their window
    # left (released, or never taken from a prefix hit).
    window_block_ids: list[int] = field(default_factory=list)
    window_released: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)  # for the age of the blocks it holds
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    tenant: str | None = None  # whose share of the shared KV store the blocks it computes count against
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when last admitted
    num_tier_tokens: int = 0  # of those, tokens loaded from a KV tier (engine/tiers/)
    block_hashes: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    index: int = 0  # the sequence's index among the request's n
    grammar: object | None = None  # engine.structured.Grammar when sampling.structured is set, else None
    prompt_logprobs: list[Logprob | None] | None = None  # gathered chunk by chunk until the first output

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks it holds a reference to: ``block_ids`` less the released ones."""
        return self.block_ids[self.released_blocks :]

    @property
    def held_window_block_ids(self) -> list[int]:
        """The window layers' blocks it holds a reference to (engine/window_pool.py)."""
        return self.window_block_ids[self.window_released :]

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
    finish_reason: FinishReason | None = None
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
