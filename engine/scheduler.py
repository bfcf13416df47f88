"""Continuous-batching scheduler: pure Python, produces a plan per step.

Each step has a token budget. Running requests go first (decodes and the
rest of chunked prompts), then waiting requests in arrival order, while the
budget, the running-sequence cap and the free blocks allow. When a running
request cannot get the block it needs, the most recently started running
request is preempted: its blocks are freed and it is recomputed later from
its prompt and the tokens it already produced (recompute, not swap).

Requests whose KV is written by someone else are parked in
WAITING_FOR_REMOTE_KV with their blocks reserved and never scheduled until
``admit_remote`` marks the prompt computed; from then on they are ordinary
running requests. In prefill mode a request stops once its prompt is
computed and its first token sampled; it keeps its blocks (PREFILLED) until
``release``.

Prefix caching (engine/prefix_cache.py): a waiting request with no blocks
first takes the longest run of cached full blocks of its tokens, leaving at
least its last token to compute so that a token is sampled, and starts with
``num_computed`` past them. After each step, every block that became full
and computed is registered by hash; only then can another request find it,
so no request ever attends over a block someone is still writing.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.prefix_cache import PrefixCache
from engine.request import NoCapacityError, Request, RequestStatus, StepOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    max_model_len: int
    mode: str
    eos_token_ids: tuple[int, ...]
    prefix_caching: bool
    cache_salt: str  # what besides tokens changes K/V (model, dtype): part of every block hash


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens ``[start, start + num_tokens)`` of ``request``; sample if ``sample``."""

    request: Request
    start: int
    num_tokens: int
    sample: bool

    @property
    def is_decode(self) -> bool:
        """One token after the prompt (not a prompt's last token, nor a recomputation)."""
        return self.num_tokens == 1 and self.start >= self.request.num_prompt_tokens


@dataclass
class SchedulePlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    prefix_queried: int = 0  # tokens of the requests admitted this step, looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached (not computed)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class SchedulerStats:
    free: int = 0  # cached blocks with no owner included: they are evicted when needed
    cached: int = 0  # cached blocks with no owner (part of ``free``)
    reserved: int = 0
    running: int = 0
    total: int = 0  # blocks in the cache
    queue_depth: int = 0  # requests waiting to be scheduled
    queued_tokens: int = 0  # prompt tokens not computed yet
    num_requests: int = 0  # requests held in any state
    num_running: int = 0  # requests being computed
    # (state, arrival time.monotonic(), blocks) of every request holding blocks; state: reserved | running
    holders: tuple[tuple[str, float, int], ...] = ()


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.prefix = PrefixCache(block_manager, config.prefix_caching, config.cache_salt)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV and PREFILLED
        self.requests: dict[str, Request] = {}

    # ---- admission -------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request) -> list[int]:
        """Reserve blocks for prompt + first token; the request waits for remote KV.

        The cached prefix (``request.num_cached_tokens``) is pinned among them:
        the remote side writes only the tokens after it.
        """
        assert request.request_id not in self.requests, request.request_id
        cached = self.prefix.lookup(request)
        fresh = self.blocks.blocks_needed(request.num_prompt_tokens + 1) - len(cached)
        needed = fresh + self.blocks.blocks_to_take(cached)
        if not self.blocks.can_allocate(needed):
            raise NoCapacityError(f"{needed} KV blocks needed, {self.blocks.num_free} free")
        self.blocks.take(cached)
        request.block_ids = cached + self.blocks.allocate(fresh)
        request.num_cached_tokens = len(cached) * self.blocks.block_size
        request.num_hashed_blocks = len(cached)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.parked[request.request_id] = request
        return list(request.block_ids)

    def admit_remote(self, request_id: str, first_token_id: int) -> StepOutput:
        request = self.parked.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"no reservation waiting for remote KV with id {request_id!r}")
        del self.parked[request_id]
        request.num_computed = request.num_prompt_tokens
        self.prefix.register(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return self._append_token(request, first_token_id)

    # ---- one step ---------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget, first_in_plan=not plan.chunks)
            if num_new == 0:
                index += 1
                continue
            if not self._grow_or_preempt(request, request.num_computed + num_new, plan):
                break  # the request itself was preempted; everything after it too
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
            index += 1
        if plan.preempted:
            return plan  # blocks are short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._admit_waiting(request, budget, plan):
                break
            num_new = self._num_new_tokens(request, budget, first_in_plan=not plan.chunks)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return plan

    def update(self, plan: SchedulePlan, sampled: dict[str, int]) -> list[StepOutput]:
        outputs = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed = chunk.start + chunk.num_tokens
            self.prefix.register(request)
            if not chunk.sample:
                continue
            token = sampled[request.request_id]
            if self.config.mode == "prefill":
                request.output_token_ids.append(token)
                if request.grammar is not None:
                    request.grammar.accept(token)  # sampled under its mask: allowed
                self.running.remove(request)
                request.status = RequestStatus.PREFILLED
                self.parked[request.request_id] = request
                outputs.append(StepOutput(request.request_id, [token], True, "prefilled", list(request.block_ids)))
            else:
                outputs.append(self._append_token(request, token))
        return outputs

    # ---- endings ------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Drop a request in any state and free its blocks. False if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.parked.pop(request_id, None)
        self._finish(request, "abort")
        return True

    def release(self, request_id: str) -> None:
        """Free the blocks a prefilled request held for its transfer."""
        request = self.parked.get(request_id)
        if request is None or request.status is not RequestStatus.PREFILLED:
            raise KeyError(f"no prefilled request with id {request_id!r}")
        del self.parked[request_id]
        self._finish(request, "prefilled")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def block_counts(self) -> dict[str, int]:
        """Blocks by state. ``free`` counts cached blocks with no owner; a block shared by a
        parked and a running request counts as running."""
        parked = {b for r in self.parked.values() for b in r.block_ids}
        if parked:
            parked -= {b for r in self.running for b in r.block_ids}
        reserved = len(parked)
        used = self.blocks.num_used
        return {"free": self.blocks.num_free, "reserved": reserved, "running": used - reserved}

    def stats(self) -> SchedulerStats:
        """Blocks by state and queue lengths, for /health and /metrics."""
        counts = self.block_counts()
        return SchedulerStats(
            free=counts["free"], cached=self.blocks.num_cached_free, reserved=counts["reserved"],
            running=counts["running"],
            total=self.blocks.num_blocks,
            queue_depth=len(self.waiting),
            queued_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed) for r in [*self.waiting, *self.running]),
            num_requests=len(self.requests),
            num_running=len(self.running),
            holders=tuple(("reserved" if r.request_id in self.parked else "running", r.arrival_time,
                           len(r.block_ids)) for r in self.requests.values() if r.block_ids),
        )

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        owners = Counter(b for r in self.requests.values() for b in r.block_ids)
        for request in self.requests.values():
            assert len(request.block_ids) == len(set(request.block_ids)), f"{request.request_id} holds a block twice"
        for block_id, n in owners.items():
            assert self.blocks.blocks[block_id].ref_count == n, f"block {block_id}: {n} owners"
        assert len(owners) == self.blocks.num_used, f"{len(owners)} blocks owned, {self.blocks.num_used} used"
        counts = self.block_counts()
        assert counts["free"] + counts["reserved"] + counts["running"] == self.blocks.num_blocks
        assert self.blocks.num_cached_free <= counts["free"]

    # ---- helpers -------------------------------------------------------------
    def _admit_waiting(self, request: Request, budget: int, plan: SchedulePlan) -> bool:
        """Give a waiting request its cached prefix and the blocks for its next chunk, or nothing."""
        assert not request.block_ids and request.num_computed == 0
        cached = self.prefix.lookup(request)
        computed = len(cached) * self.blocks.block_size
        num_new = self._num_new_tokens(request, budget, first_in_plan=not plan.chunks, computed=computed)
        if num_new == 0:
            return False
        fresh = self.blocks.blocks_needed(computed + num_new) - len(cached)
        if not self.blocks.can_allocate(fresh + self.blocks.blocks_to_take(cached)):
            return False
        self.blocks.take(cached)
        request.block_ids = cached + self.blocks.allocate(fresh)
        request.num_computed = request.num_cached_tokens = computed
        request.num_hashed_blocks = len(cached)
        if self.config.prefix_caching:
            plan.prefix_queried += request.num_tokens
            plan.prefix_hits += computed
        return True

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of a request not admitted yet that would be found cached now."""
        return len(self.prefix.lookup(request)) * self.blocks.block_size

    def _num_new_tokens(self, request: Request, budget: int, first_in_plan: bool, computed: int | None = None) -> int:
        remaining = request.num_tokens - (request.num_computed if computed is None else computed)
        if remaining <= budget:
            return remaining
        if self.config.chunked_prefill or first_in_plan:
            return budget  # without chunking, an oversized prompt still runs alone
        return 0

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed
        return ScheduledChunk(request, start, num_new, sample=start + num_new == request.num_tokens)

    def _grow_or_preempt(self, request: Request, num_tokens: int, plan: SchedulePlan) -> bool:
        while not self.blocks.grow(request.block_ids, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.num_computed = request.num_hashed_blocks = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _append_token(self, request: Request, token: int) -> StepOutput:
        request.output_token_ids.append(token)
        if request.grammar is not None and not request.grammar.accept(token):
            # Only a remote first token can get here (sampled ones obey the mask): fail, never emit invalid output.
            log.warning("request %s: token %d breaks its grammar: %s", request.request_id, token,
                        request.grammar.error())
            self.running.remove(request)
            self._finish(request, "abort")
            return StepOutput(request.request_id, [], True, "abort")
        reason = self._stop_reason(request, token)
        if reason is not None:
            self.running.remove(request)
            self._finish(request, reason)
            return StepOutput(request.request_id, [token], True, reason)
        return StepOutput(request.request_id, [token], False)

    def _stop_reason(self, request: Request, token: int) -> str | None:
        sampling = request.sampling
        if not sampling.ignore_eos and token in self.config.eos_token_ids:
            return "stop"
        if token in sampling.stop_token_ids:
            return "stop"
        if request.grammar is not None and request.grammar.done:
            return "stop"  # the grammar accepted EOS: complete, even with ignore_eos
        if len(request.output_token_ids) >= sampling.max_tokens:
            return "length"
        if request.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
        del self.requests[request.request_id]
