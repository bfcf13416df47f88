"""Continuous-batching scheduler: pure Python, produces a plan per step.

Each step has a token budget. Running requests go first (decodes and the
rest of chunked prompts), then waiting requests in arrival order, while the
budget, the running-sequence cap and the free blocks allow; but a prompt
with more tokens left than one step's budget is long: while one long prompt
is prefilled, other long ones wait and shorter ones pass them, and beside
other requests (running or waiting) a long prompt is computed at most a
quarter of the budget a step, so that their steps stay short. When
a running request cannot get the block it needs, a sequence is preempted:
the most recently started one of a request holding more than an equal share
of the cache among the running requests, else the most recently started
one. Its blocks are freed and it is recomputed later from its prompt and the
tokens it already produced (recompute, not swap).

Requests whose KV is written by someone else are parked in
WAITING_FOR_REMOTE_KV with their blocks reserved and never scheduled until
``admit_remote`` marks the prompt computed; from then on they are ordinary
running requests. A read of a reservation's cached prefix by another server
``pin``s the blocks it reads (one more reference each, ``unpin`` drops it): the
bytes are copied off the engine thread meanwhile, and a pinned block is never
freed, evicted or handed out, even when its reservation ends first. In prefill mode a request stops once its prompt is
computed and its first token sampled; it keeps its blocks (PREFILLED) until
``release``.

A model mixing sliding-window and full-attention layers may keep the window layers' blocks in a pool
of their own (``window_pool``, engine/window_pool.py; colocated only): each sequence then grows two
tables, gives back the window blocks its next query no longer reads before each step, and is admitted or
grown only when both pools have the blocks; a preempted or finished one frees both.

Prefix caching (engine/prefix_cache.py): a waiting request with no blocks
first takes the longest run of cached full blocks of its tokens, leaving at
least its last token to compute so that a token is sampled, and starts with
``num_computed`` past them. After each step, every block that became full
and computed is registered by hash; only then can another request find it,
so no request ever attends over a block someone is still writing. A request
asking for prompt log-probabilities takes nothing from the cache (as vLLM):
every prompt position's logits must be computed.

A request with ``sampling.n > 1`` is one sequence until its first tokens are
drawn (n of them, from its last prompt row, or given to ``admit_remote``);
then sequences 1..n-1 are forked from it (engine/sequences.py): each shares
the prompt's full blocks by reference count and gets its own copy of the
block holding the prompt's partial last block, written past the prompt. The
copies are queued in ``block_copies`` for the engine to make right after the
call that forked, before anything can write into their sources. A fork that
finds no free block for its copy, or ``max_num_seqs`` sequences running,
waits to be recomputed like a preempted sequence (as every fork does with a window pool, where
the parent gave back its prompt's first window blocks). Sequences run, are
preempted and finish on their own (when a drawn token ends one:
``record_token`` in engine/sequences.py); ``abort`` ends them all. ``requests`` maps a request id to its live sequences.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineMode
from engine.prefix_cache import BlockTiers, PrefixCache
from engine.request import (
    ChunkResult,
    FinishReason,
    Logprob,
    NoCapacityError,
    Request,
    RequestStatus,
    StepOutput,
    window_start,
)
from engine.sequences import fork_sequence, record_token
from engine.window_pool import WindowPool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    max_model_len: int
    mode: EngineMode
    eos_token_ids: tuple[int, ...]
    prefix_caching: bool
    cache_salt: str  # what besides tokens changes K/V (model, dtype): part of every block hash
    window: int | None = None  # the widest sliding window of the model's layers; None: no layer has one
    # Every layer's window when every layer has one (their widest): a decoding sequence's blocks before it
    # are never read again and are released. None: some layer attends over everything.
    release_window: int | None = None


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
    tier_hits: int = 0  # of those, tokens loaded from a lower tier (engine/tiers/)

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
    read_pins: int = 0  # reads of a reservation's prefix holding its blocks now (``Scheduler.pin``)
    # (state, arrival time.monotonic(), blocks) of every request holding blocks; state: reserved | running
    holders: tuple[tuple[str, float, int], ...] = ()


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        tiers: BlockTiers | None = None,
        window_pool: WindowPool | None = None,
    ) -> None:
        """``tiers``: where a waiting request's prefix continues past the cache (engine/tiers/kv.py);
        ``window_pool``: the window layers' own blocks (engine/window_pool.py; ``block_manager`` then holds
        the full-attention layers' only). A scheduler with a window pool computes every request itself."""
        assert window_pool is None or (config.mode == "colocated" and tiers is None), "a window pool is colocated"
        self.config = config
        self.blocks = block_manager
        self.tiers = tiers
        self.window_pool = window_pool
        self.prefix = PrefixCache(block_manager, config.prefix_caching, config.cache_salt, config.window, window_pool)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV and PREFILLED (sequence 0 only)
        self.requests: dict[str, list[Request]] = {}  # request id -> its live sequences
        self.block_copies: list[tuple[int, int]] = []  # (source, destination) blocks of forks, to copy now
        self.pins: dict[int, list[int]] = {}  # pin id -> blocks a read holds one reference to (``pin``)
        self._next_pin = 0

    # ---- admission -------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = [request]
        self.waiting.append(request)

    def reserve(self, request: Request) -> list[int]:
        """Reserve blocks for prompt + first token; the request waits for remote KV.

        The cached prefix (``request.num_cached_tokens``) is pinned among them:
        the remote side writes only the tokens after it.
        """
        assert request.request_id not in self.requests, request.request_id
        assert self.window_pool is None, "a window pool is colocated: nothing is written remotely"
        cached = self.prefix.lookup(request)
        tiered = self.prefix.lookup_tiers(request, cached, self.tiers)
        tail = 0 if tiered else self.prefix.tail_hit(request, len(cached))
        fresh = self.blocks.blocks_needed(request.num_prompt_tokens + 1) - len(cached)
        needed = fresh + self.blocks.blocks_to_take(cached)
        if not self.blocks.can_allocate(needed):
            raise NoCapacityError(f"{needed} KV blocks needed, {self.blocks.num_free} free")
        self.blocks.take(cached)
        taken = self.prefix.take_tail(request, len(cached)) if tail else None  # before allocate can evict it
        request.block_ids = cached + ([taken[0]] if taken else []) + self.blocks.allocate(fresh - (1 if taken else 0))
        loaded = 0
        if tiered:  # blocks a tier does not serve intact are simply written remotely with the rest
            assert self.tiers is not None
            loaded = self.tiers.load(tiered, request.block_ids[len(cached) : len(cached) + len(tiered)])
        request.num_cached_tokens = (len(cached) + loaded) * self.blocks.block_size + (taken[1] if taken else 0)
        request.num_tier_tokens = loaded * self.blocks.block_size
        request.num_hashed_blocks = len(cached)  # loaded blocks are registered with the rest in admit_remote
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = [request]
        self.parked[request.request_id] = request
        return list(request.block_ids)

    def admit_remote(self, request_id: str, first_token_ids: list[int]) -> list[StepOutput]:
        """The prompt's KV is in the reserved blocks and its first tokens (one per
        sequence) were drawn remotely: the request's sequences start decoding.
        Their outputs carry no log-probabilities (the remote side has them)."""
        request = self.parked.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"no reservation waiting for remote KV with id {request_id!r}")
        if len(first_token_ids) != request.sampling.n:
            raise ValueError(f"{len(first_token_ids)} first tokens for a request of n={request.sampling.n}")
        del self.parked[request_id]
        request.num_computed = request.num_prompt_tokens
        self.prefix.mark_remote(request)
        self.prefix.register(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return self._start_sequences(request, ChunkResult(list(first_token_ids)), None)

    def pin(self, block_ids: Sequence[int]) -> int:
        """One more reference to each of ``block_ids`` (owned blocks: a reservation's cached prefix), for a
        read that copies them off the engine thread: none of them is freed, evicted or handed out until
        ``unpin`` with the id returned, whoever else lets go of them first."""
        self.blocks.share(block_ids)
        self._next_pin += 1
        self.pins[self._next_pin] = list(block_ids)
        return self._next_pin

    def unpin(self, pin_id: int) -> None:
        """Drop the references ``pin`` took (blocks no request holds any more go back to free or cached-free).
        KeyError: no such pin (each is dropped once)."""
        self.blocks.free(self.pins.pop(pin_id))

    # ---- one step ---------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        # Beside other requests, a long prompt is computed a quarter step at a time, so their steps stay short.
        contended = any(not self._is_long(r) for r in (*self.running, *self.waiting))
        long_chunk = self._long_chunk() if contended else self.config.max_num_batched_tokens
        for request in list(self.running):
            budget = self.config.max_num_batched_tokens - plan.num_tokens
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted in this loop, for a request before it
            if self._is_long(request):
                budget = min(budget, long_chunk)
            num_new = self._num_new_tokens(request, budget, first_in_plan=not plan.chunks)
            if num_new and self.config.release_window is not None:
                self._release_out_of_window(request, self.config.release_window)
            if num_new and self.window_pool is not None:
                self.window_pool.release(request)
            if num_new and self._grow_or_preempt(request, request.num_computed + num_new, plan):
                plan.chunks.append(self._chunk(request, num_new))
        if plan.preempted:
            return plan  # blocks are short: admit nothing new this step
        self._admit(plan, long_chunk)
        return plan

    def update(self, plan: SchedulePlan, results: dict[Request, ChunkResult]) -> list[StepOutput]:
        """Records what the runner computed for the plan (engine/runner.py)."""
        outputs = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed = chunk.start + chunk.num_tokens
            self.prefix.register(request)
            result = results.get(request)
            if result is not None and result.prompt_logprobs is not None:
                request.prompt_logprobs = (request.prompt_logprobs if chunk.start else []) + result.prompt_logprobs
            if not chunk.sample:
                continue
            prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            if self.config.mode == "prefill":
                self._record(request, result.token_ids[0])  # sampled under its mask; the prefill ends here anyway
                self.running.remove(request)
                request.status = RequestStatus.PREFILLED
                self.parked[request.request_id] = request
                outputs.append(
                    StepOutput(
                        request.request_id,
                        list(result.token_ids),
                        True,
                        "prefilled",
                        list(request.block_ids),
                        result.logprobs,
                        prompt_logprobs,
                    )
                )
            elif len(result.token_ids) > 1:
                outputs += self._start_sequences(request, result, prompt_logprobs)
            else:
                outputs.append(
                    self._append_token(
                        request, result.token_ids[0], result.logprobs and result.logprobs[0], prompt_logprobs
                    )
                )
        return outputs

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies forks asked for since the last call."""
        copies, self.block_copies = self.block_copies, []
        return copies

    # ---- endings ------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Drop a request in any state and free its blocks. False if unknown."""
        sequences = self.requests.get(request_id)
        if sequences is None:
            return False
        for request in list(sequences):
            if request in self.waiting:
                self.waiting.remove(request)
            if request in self.running:
                self.running.remove(request)
            if self.parked.get(request_id) is request:
                del self.parked[request_id]
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
        parked and a running request counts as running; one a read's pin alone holds (its reservation
        gone) counts as reserved."""
        parked = {b for r in self.parked.values() for b in r.held_block_ids}
        parked.update(b for ids in self.pins.values() for b in ids)
        if parked:
            parked -= {b for r in self.running for b in r.held_block_ids}
        reserved = len(parked)
        used = self.blocks.num_used
        return {"free": self.blocks.num_free, "reserved": reserved, "running": used - reserved}

    def stats(self) -> SchedulerStats:
        """Blocks by state and queue lengths, for /health and /metrics."""
        counts = self.block_counts()
        return SchedulerStats(
            free=counts["free"],
            cached=self.blocks.num_cached_free,
            reserved=counts["reserved"],
            running=counts["running"],
            total=self.blocks.num_blocks,
            queue_depth=len(self.waiting),
            queued_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed) for r in [*self.waiting, *self.running]),
            num_requests=len(self.requests),
            num_running=len(self.running),
            read_pins=len(self.pins),
            holders=tuple(
                ("reserved" if self.parked.get(r.request_id) is r else "running", r.arrival_time, len(r.held_block_ids))
                for r in self.sequences()
                if r.held_block_ids
            ),
        )

    def sequences(self) -> list[Request]:
        """Every live sequence of every request."""
        return [r for sequences in self.requests.values() for r in sequences]

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        owners = Counter(b for r in self.sequences() for b in r.held_block_ids)
        owners.update(b for ids in self.pins.values() for b in ids)
        for request in self.sequences():
            held = request.held_block_ids
            assert len(held) == len(set(held)), f"{request.request_id} holds a block twice"
        for block_id, n in owners.items():
            assert self.blocks.blocks[block_id].ref_count == n, f"block {block_id}: {n} owners"
        assert len(owners) == self.blocks.num_used, f"{len(owners)} blocks owned, {self.blocks.num_used} used"
        counts = self.block_counts()
        assert counts["free"] + counts["reserved"] + counts["running"] == self.blocks.num_blocks
        assert self.blocks.num_cached_free <= counts["free"]
        if self.window_pool is not None:
            self.window_pool.check_integrity(self.sequences())

    # ---- helpers -------------------------------------------------------------
    def _admit(self, plan: SchedulePlan, long_chunk: int) -> None:
        """Waiting requests in arrival order, while the budget, ``max_num_seqs`` and the blocks allow;
        but while one long prompt is being prefilled, other long ones wait and shorter ones pass
        them, so that a few long prompts (scored ones above all) cannot hold up every short one.
        A long one starts with at most ``long_chunk`` tokens."""
        long_running = any(self._is_long(r) for r in self.running)
        position = 0
        while position < len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            budget = self.config.max_num_batched_tokens - plan.num_tokens
            if budget <= 0:
                return
            request = self.waiting[position]
            if long_running and self._is_long(request):
                position += 1
                continue
            if self._is_long(request):
                budget = min(budget, long_chunk)
            if not self._admit_waiting(request, budget, plan):
                return
            num_new = self._num_new_tokens(request, budget, first_in_plan=not plan.chunks)
            del self.waiting[position]
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.chunks.append(self._chunk(request, num_new))
            long_running = long_running or self._is_long(request)

    def _long_chunk(self) -> int:
        """The most tokens of a long prompt computed in a step shared with other requests: a quarter
        of the budget (vLLM's long_prefill_token_threshold does the same)."""
        return max(1, self.config.max_num_batched_tokens // 4)

    def _is_long(self, request: Request) -> bool:
        """Whether the request has more prompt (or recomputed) tokens left than one step computes
        (with chunked prefill: without it, such a prompt runs alone anyway)."""
        return (
            self.config.chunked_prefill
            and request.num_tokens - 1 - request.num_computed > self.config.max_num_batched_tokens
        )

    def _admit_waiting(self, request: Request, budget: int, plan: SchedulePlan) -> bool:
        """Give a waiting request its cached prefix and the blocks for its next chunk, or nothing."""
        assert not request.block_ids and request.num_computed == 0
        looks_up = self.config.prefix_caching and not request.wants_prompt_logprobs
        cached = self.prefix.lookup(request)
        tiered = self.prefix.lookup_tiers(request, cached, self.tiers)
        found = len(cached) + len(tiered)
        tail = self.prefix.tail_hit(request, found)  # after the tiers' blocks too (an offered prefix's end)
        computed = found * self.blocks.block_size + tail
        first_in_plan = not plan.chunks
        num_new = self._num_new_tokens(request, budget, first_in_plan, computed=computed)
        if num_new == 0:
            return False
        fresh = self.blocks.blocks_needed(computed + num_new) - len(cached)
        if not self.blocks.can_allocate(fresh + self.blocks.blocks_to_take(cached)):
            return False
        window_ids = self.prefix.window_hit(request, len(cached))
        assert window_ids is not None  # lookup kept only a hit whose window blocks are cached
        if self.window_pool is not None and not self.window_pool.blocks.can_allocate(
            fresh + self.window_pool.blocks.blocks_to_take(window_ids)
        ):
            return False
        self.blocks.take(cached)
        taken = self.prefix.take_tail(request, found) if tail else None  # before allocate can evict it
        assert bool(taken) == bool(tail) and (taken is None or taken[1] == tail), (taken, tail)
        request.block_ids = cached + self.blocks.allocate(len(tiered))
        if taken:
            request.block_ids.append(taken[0])
        request.block_ids += self.blocks.allocate(fresh - len(tiered) - (1 if taken else 0))
        if self.window_pool is not None:
            self.window_pool.take(request, len(cached), window_ids)
            self.window_pool.grow(request, computed + num_new)
        if tiered:
            loaded = self._load_tiered(request, tiered, len(cached), budget, first_in_plan)
            if loaded is None:
                return False
            if loaded < len(tiered):  # the tail, if taken, is past the run: its block is computed over
                tail = 0
            computed = (len(cached) + loaded) * self.blocks.block_size + tail
            plan.tier_hits += loaded * self.blocks.block_size
        request.num_computed = request.num_cached_tokens = computed
        request.num_hashed_blocks = len(cached)  # loaded blocks are registered once this step ends
        request.num_tier_tokens = computed - len(cached) * self.blocks.block_size - tail
        if looks_up:
            plan.prefix_queried += request.num_tokens
            plan.prefix_hits += computed
        return True

    def _load_tiered(
        self, request: Request, tiered: list[int], num_cached: int, budget: int, first_in_plan: bool
    ) -> int | None:
        """Load blocks ``tiered`` into the request's fresh blocks after its ``num_cached`` cached ones;
        how many loaded. A block no tier served intact ends the run: the rest is computed, within the
        blocks already taken (fewer tokens cached never need more blocks for the step's chunk); blocks
        left over are freed. None (and every block freed) when the shorter hit leaves nothing to compute
        this step."""
        ids = request.block_ids
        assert self.tiers is not None
        loaded = self.tiers.load(tiered, ids[num_cached : num_cached + len(tiered)])
        if loaded == len(tiered):
            return loaded
        computed = (num_cached + loaded) * self.blocks.block_size
        num_new = self._num_new_tokens(request, budget, first_in_plan, computed=computed)
        keep = self.blocks.blocks_needed(computed + num_new) if num_new else 0
        assert keep <= len(ids), (keep, len(ids))
        self.blocks.free(ids[keep:])
        del ids[keep:]
        return loaded if num_new else None

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of a request not admitted yet that would be found cached now, in the cache or in a
        tier (whose entries are checked only when loaded: a corrupt one makes the hit shorter)."""
        cached = self.prefix.lookup(request)
        tiered = self.prefix.lookup_tiers(request, cached, self.tiers)
        found = len(cached) + len(tiered)
        return found * self.blocks.block_size + self.prefix.tail_hit(request, found)

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
        """Blocks for ``request`` up to ``num_tokens``, preempting sequences until they fit; False
        when the request itself was preempted. A preempted sequence's chunk leaves the plan."""
        while not self._grow(request, num_tokens):
            victim = self._victim()
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            plan.chunks = [c for c in plan.chunks if c.request is not victim]
            if victim is request:
                return False
        return True

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Extend the request's block tables to hold ``num_tokens``; False (nothing taken) if blocks ran out."""
        pool = self.window_pool
        if pool is None:
            return self.blocks.grow(request.block_ids, num_tokens)
        missing = max(self.blocks.blocks_needed(num_tokens) - len(request.block_ids), 0)
        if not (self.blocks.can_allocate(missing) and pool.blocks.can_allocate(pool.missing(request, num_tokens))):
            return False
        self.blocks.grow(request.block_ids, num_tokens)
        pool.grow(request, num_tokens)
        return True

    def _release_out_of_window(self, request: Request, window: int) -> None:
        """Release the blocks of a decoding sequence that every layer's window has left: its next query,
        at ``num_computed``, reads keys (num_computed - window, num_computed] and every later one reads
        later keys. Once its prompt is computed (and its forks took their share of the prompt's blocks);
        whole blocks only; a block still cached keeps its K/V for whoever finds it (BlockManager.free)."""
        if request.num_computed < request.num_prompt_tokens:
            return
        below = window_start(request.num_computed, window) // self.blocks.block_size
        if below > request.released_blocks:
            self.blocks.free(request.block_ids[request.released_blocks : below])
            request.released_blocks = below

    def _victim(self) -> Request:
        """The sequence to preempt: the most recently started one of a request holding more
        blocks than an equal share of the cache among the running requests (the greedy one
        yields first: ``n`` long sequences, or a very long one), else of any request."""
        held: Counter[str] = Counter()
        for request in self.running:
            held[request.request_id] += len(request.held_block_ids)
        share = self.blocks.num_blocks / len(held)
        greedy = [r for r in self.running if held[r.request_id] > share]
        return (greedy or self.running)[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free_blocks(request)
        request.num_computed = request.num_hashed_blocks = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _start_sequences(
        self, request: Request, first: ChunkResult, prompt_logprobs: list[Logprob | None] | None
    ) -> list[StepOutput]:
        """A request's first tokens, sequence i's at i: sequences 1.. are forked from
        ``request`` (sequence 0, its prompt computed) before its own token is appended."""
        outputs = []
        for index in range(1, len(first.token_ids)):
            child = fork_sequence(request, index)
            token = first.token_ids[index]
            reason = self._record(child, token)
            if reason is None:
                self.requests[request.request_id].append(child)
                self._place_fork(child, request)
            else:
                child.status, child.finish_reason = RequestStatus.FINISHED, reason
            outputs.append(self._output(child, token, reason, first.logprobs and first.logprobs[index]))
        own = self._append_token(request, first.token_ids[0], first.logprobs and first.logprobs[0], prompt_logprobs)
        return [own, *outputs]

    def _place_fork(self, child: Request, parent: Request) -> None:
        """Share the parent's full prompt blocks and copy its partial last one; with no
        free block for the copy, or ``max_num_seqs`` running, wait to be recomputed."""
        full, partial = divmod(parent.num_prompt_tokens, self.blocks.block_size)
        # With a window pool the parent released the prompt's first window blocks: the fork recomputes (its
        # prompt found in the prefix cache where it is on).
        if (
            self.window_pool is not None
            or not self.blocks.can_allocate(1 if partial else 0)
            or len(self.running) >= self.config.max_num_seqs
        ):
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)
            return
        shared = parent.block_ids[:full]
        self.blocks.share(shared)
        child.block_ids = shared + (self.blocks.allocate(1) if partial else [])
        if partial:
            self.block_copies.append((parent.block_ids[full], child.block_ids[full]))
        child.num_computed = parent.num_prompt_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_hashes = parent.block_hashes[:full]
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def _append_token(
        self,
        request: Request,
        token: int,
        logprob: Logprob | None = None,
        prompt_logprobs: list[Logprob | None] | None = None,
    ) -> StepOutput:
        reason = self._record(request, token)
        if reason is not None:
            self.running.remove(request)
            self._finish(request, reason)
        return self._output(request, token, reason, logprob, prompt_logprobs)

    @staticmethod
    def _output(
        request: Request,
        token: int,
        reason: str | None,
        logprob: Logprob | None = None,
        prompt_logprobs: list[Logprob | None] | None = None,
    ) -> StepOutput:
        """A sequence's output for one recorded token; a token its grammar refused is never emitted."""
        if reason == "grammar":
            return StepOutput(request.request_id, [], True, reason, index=request.index)
        return StepOutput(
            request.request_id,
            [token],
            reason is not None,
            reason,
            logprobs=None if logprob is None else [logprob],
            prompt_logprobs=prompt_logprobs,
            index=request.index,
        )

    def _record(self, request: Request, token: int) -> FinishReason | None:
        return record_token(request, token, self.config.eos_token_ids, self.config.max_model_len)

    def _free_blocks(self, request: Request) -> None:
        """Give back every block the request holds, in both pools."""
        self.blocks.free(request.held_block_ids)
        request.block_ids, request.released_blocks = [], 0
        if self.window_pool is not None:
            self.window_pool.free(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if reason != "abort":  # its last, partial block stays findable for the next turn
            self.prefix.keep_tail(request)
        self._free_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
        sequences = self.requests[request.request_id]
        sequences.remove(request)
        if not sequences:
            del self.requests[request.request_id]
