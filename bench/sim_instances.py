"""Engine instances of the simulator: what one step of each one computes.

Two kinds, mirroring the engine's modes:

* :class:`ServingInstance` is a colocated engine or a decode server. It
  decodes its running requests and prefills local ones (every request when
  colocated; short prompts under conditional disaggregation on D); remote
  requests join ``running`` when their KV has arrived.
* :class:`PrefillInstance` prefills prompts and hands them off.

Scheduling follows the engine: continuous batching, a token budget per
step (``max_num_batched_tokens``), ``max_num_seqs`` running, FIFO, chunked
prefill. Policy ``mixed`` puts decodes first and fills the rest of the
budget with prefill chunks in the same step (vLLM v1); ``prefill_first``
runs a prefill-only step whenever a prompt waits and a decode-only step
otherwise (nano-vllm).

KV blocks: a request holds ceil((prompt + output) / block_size) blocks from
admission (D: from reservation) until it finishes. Reserving the worst case
means no preemption is ever needed, so the simulator does not model it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from bench.costmodel import StepCost, chunk_attn_pairs


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


@dataclass(frozen=True)
class StepPlan:
    """Tokens each request computes in one step, and what the step costs."""

    work: tuple[tuple[SimRequest, int], ...]
    seconds: float


class _Instance:
    def __init__(self, name: str, spec: InstanceSpec):
        self.name = name
        self.spec = spec
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = spec.kv_blocks
        self.busy_until: float | None = None  # end of the step in flight
        self.busy_seconds = 0.0

    def can_hold(self, req: SimRequest) -> bool:
        """Whether the request could ever fit this instance's KV cache."""
        return self.spec.kv_blocks is None or self.spec.blocks_for(req.prompt_len + req.output_len) <= self.spec.kv_blocks

    def try_allocate(self, req: SimRequest) -> bool:
        if self.free_blocks is None:
            return True
        need = self.spec.blocks_for(req.prompt_len + req.output_len)
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        return True

    def release(self, req: SimRequest) -> None:
        if self.free_blocks is not None:
            self.free_blocks += self.spec.blocks_for(req.prompt_len + req.output_len)

    def _prefill_work(self, budget: int, slots: int, now: float) -> list[tuple[SimRequest, int]]:
        """Continue running prompts, then admit waiting ones, within budget."""
        work = []
        for req in self.running:
            if budget <= 0:
                break
            if req.prefilling:
                n = self._chunk(req, budget)
                if n:
                    work.append((req, n))
                    budget -= n
        while self.waiting and budget > 0 and slots > 0:
            req = self.waiting[0]
            n = self._chunk(req, budget)
            if not n or not self.try_allocate(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.prefill_start = now
            work.append((req, n))
            budget -= n
            slots -= 1
        return work

    def _chunk(self, req: SimRequest, budget: int) -> int:
        left = req.prompt_len - req.num_computed
        if left <= budget:
            return left
        return budget if self.spec.chunked_prefill else 0

    def plan_step(self, now: float) -> StepPlan | None:
        raise NotImplementedError

    def _cost(self, work: list[tuple[SimRequest, int]]) -> StepPlan:
        tokens = sum(n for _, n in work)
        pairs = sum(chunk_attn_pairs(r.num_computed, r.num_computed + n) if r.prefilling
                    else r.prompt_len + r.generated for r, n in work)
        seqs = sum(1 for r, n in work if not r.prefilling or r.num_computed + n == r.prompt_len)
        return StepPlan(tuple(work), self.spec.cost.step_time(tokens, pairs, seqs))

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
        spec = self.spec
        decodes = [r for r in self.running if not r.prefilling]
        prefills = any(r.prefilling for r in self.running) or bool(self.waiting)
        if spec.policy == "prefill_first" and prefills:
            work = self._prefill_work(spec.max_num_batched_tokens, spec.max_num_seqs - len(self.running), now)
            if work:
                return self._cost(work)
        work = [(r, 1) for r in decodes[: spec.max_num_batched_tokens]]
        if spec.policy == "mixed":
            slots = spec.max_num_seqs - len(self.running)
            work += self._prefill_work(spec.max_num_batched_tokens - len(work), slots, now)
        return self._cost(work) if work else None

    def load(self) -> int:
        return super().load() + len(self.reserved) + len(self.pending) + len(self.inbox)


class PrefillInstance(_Instance):
    """A prefill server: prefill-only steps; requests leave when done."""

    def plan_step(self, now: float) -> StepPlan | None:
        work = self._prefill_work(self.spec.max_num_batched_tokens, self.spec.max_num_seqs - len(self.running), now)
        return self._cost(work) if work else None

    def queued_tokens(self) -> int:
        return sum(r.prompt_len - r.num_computed for r in (*self.running, *self.waiting))
