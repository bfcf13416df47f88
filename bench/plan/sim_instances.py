"""Engine instances of the simulator: what one step of each one computes.

Two kinds, mirroring the engine's modes:

* :class:`ServingInstance` is a colocated engine or a decode server. It
  decodes its running requests and prefills local ones (every request when
  colocated; short prompts under conditional disaggregation on D); remote
  requests join ``running`` when their KV has arrived.
* :class:`PrefillInstance` prefills prompts and hands them off.

Scheduling follows the engine's scheduler: a token budget per step
(``max_num_batched_tokens``); running requests first, in order (one token
per decode, the next chunk of a prompt), then waiting ones in arrival order
while the budget, ``max_num_seqs`` and free blocks allow; without chunked
prefill a prompt over the budget still runs when it is first in the step.
That is policy ``mixed`` (as vLLM v1). ``prefill_first`` (nano-vllm) runs
prefill-only steps while prompts wait and decode-only steps otherwise.

KV blocks: a request holds ceil((prompt + output) / block_size) blocks from
admission (D: from reservation) until it finishes. The engine allocates as
tokens grow and preempts (recompute) when it runs out; reserving the worst
case up front never needs preemption, so the simulator does not model it.
The two agree whenever the cache is not the bottleneck; near capacity the
simulator admits fewer requests than the engine does.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from bench.plan.costmodel import StepCost, decode_keys, prefill_pairs


@dataclass(frozen=True)
class InstanceSpec:
    cost: StepCost
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    kv_blocks: int | None = None  # None: unlimited
    block_size: int = 16
    policy: str = "mixed"  # mixed | prefill_first

    def __post_init__(self):
        if self.policy not in ("mixed", "prefill_first"):
            raise ValueError(f"unknown policy {self.policy!r}: use mixed or prefill_first")

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


@dataclass(eq=False)
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    num_computed: int = 0  # prompt tokens whose KV exists
    generated: int = 0  # output tokens produced (the first one included)
    token_times: list[float] = field(default_factory=list)
    prefill_start: float | None = None
    remote: bool = False  # prefilled on a prefill instance
    error: str | None = None
    done_at: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len


STEP_KINDS = ("prefill", "decode", "mixed")  # engine.engine.STEP_KINDS


@dataclass(frozen=True)
class StepPlan:
    """Tokens each request computes in one step, and what the step costs."""

    work: tuple[tuple[SimRequest, int], ...]
    seconds: float

    @property
    def kind(self) -> str:
        prefill = any(r.prefilling for r, _ in self.work)
        decode = any(not r.prefilling for r, _ in self.work)
        return "mixed" if prefill and decode else "prefill" if prefill else "decode"


class _Instance:
    def __init__(self, name: str, spec: InstanceSpec):
        self.name = name
        self.spec = spec
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = spec.kv_blocks
        self.busy_until: float | None = None  # end of the step in flight
        self.busy_seconds = 0.0
        self.steps = {kind: [0, 0.0] for kind in STEP_KINDS}  # kind -> [count, seconds], as the engine counts

    def tokens_held(self, req: SimRequest) -> int:
        """KV tokens a request holds here: its whole sequence (worst case)."""
        return req.prompt_len + req.output_len

    def can_hold(self, req: SimRequest) -> bool:
        """Whether the request could ever fit this instance's KV cache."""
        return self.spec.kv_blocks is None or self.spec.blocks_for(self.tokens_held(req)) <= self.spec.kv_blocks

    def try_allocate(self, req: SimRequest) -> bool:
        if self.free_blocks is None:
            return True
        need = self.spec.blocks_for(self.tokens_held(req))
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        return True

    def release(self, req: SimRequest) -> None:
        if self.free_blocks is not None:
            self.free_blocks += self.spec.blocks_for(self.tokens_held(req))

    def _running_work(self, budget: int, decodes: bool, prefills: bool) -> list[tuple[SimRequest, int]]:
        """Running requests in order, as the engine does: 1 token per decode,
        the next chunk of a prompt, until the budget is spent."""
        work = []
        for req in self.running:
            if budget <= 0:
                break
            if req.prefilling and prefills:
                n = self._chunk(req, budget, first=not work)
            elif not req.prefilling and decodes:
                n = 1
            else:
                continue
            if n:
                work.append((req, n))
                budget -= n
        return work

    def _admit_waiting(self, work: list, budget: int, now: float) -> list[tuple[SimRequest, int]]:
        """Then waiting requests in arrival order, while budget, seats and blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.spec.max_num_seqs:
            req = self.waiting[0]
            n = self._chunk(req, budget, first=not work)
            if not n or not self.try_allocate(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.prefill_start = now
            work.append((req, n))
            budget -= n
        return work

    def _chunk(self, req: SimRequest, budget: int, first: bool) -> int:
        left = req.prompt_len - req.num_computed
        if left <= budget:
            return left
        # Without chunking an oversized prompt still runs, alone, budget by budget.
        return budget if self.spec.chunked_prefill or first else 0

    def plan_step(self, now: float) -> StepPlan | None:
        raise NotImplementedError

    def _cost(self, work: list[tuple[SimRequest, int]]) -> StepPlan:
        tokens = sum(n for _, n in work)
        pairs = prefill_pairs([(r.num_computed, r.num_computed + n) for r, n in work if r.prefilling])
        keys = decode_keys([r.prompt_len + r.generated - 1 for r, n in work if not r.prefilling])
        seqs = sum(1 for r, n in work if not r.prefilling or r.num_computed + n == r.prompt_len)
        return StepPlan(tuple(work), self.spec.cost.step_time(tokens, pairs, seqs, keys))

    def load(self) -> int:
        return len(self.waiting) + len(self.running)


class ServingInstance(_Instance):
    """A colocated engine or a decode server."""

    def __init__(self, name: str, spec: InstanceSpec):
        super().__init__(name, spec)
        self.reserved: list[SimRequest] = []  # remote, blocks held, KV not yet here
        self.pending: deque[SimRequest] = deque()  # remote, waiting for blocks
        self.inbox: list[SimRequest] = []  # KV arrived, admitted at the next step boundary

    def plan_step(self, now: float) -> StepPlan | None:
        budget = self.spec.max_num_batched_tokens
        if self.spec.policy == "prefill_first" and (self.waiting or any(r.prefilling for r in self.running)):
            work = self._running_work(budget, decodes=False, prefills=True)
            work = self._admit_waiting(work, budget - sum(n for _, n in work), now)
            if work:
                return self._cost(work)
        work = self._running_work(budget, decodes=True, prefills=self.spec.policy == "mixed")
        if self.spec.policy == "mixed":
            work = self._admit_waiting(work, budget - sum(n for _, n in work), now)
        return self._cost(work) if work else None

    def load(self) -> int:
        return super().load() + len(self.reserved) + len(self.pending) + len(self.inbox)


class PrefillInstance(_Instance):
    """A prefill server: prefill-only steps; requests leave when done.

    A prefilled request keeps its blocks (prompt + first token) until its
    KV has reached D, as the engine's PREFILLED state does until release.
    """

    def tokens_held(self, req: SimRequest) -> int:
        return req.prompt_len + 1

    def plan_step(self, now: float) -> StepPlan | None:
        budget = self.spec.max_num_batched_tokens
        work = self._running_work(budget, decodes=False, prefills=True)
        work = self._admit_waiting(work, budget - sum(n for _, n in work), now)
        return self._cost(work) if work else None

    def queued_tokens(self) -> int:
        return sum(r.prompt_len - r.num_computed for r in (*self.running, *self.waiting))
