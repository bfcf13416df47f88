"""The engine: model + KV cache + scheduler, stepped by its owner.

A step is three lines: plan = schedule(); tokens = runner.run(plan);
outputs = scheduler.update(plan, tokens). The engine is not thread-safe: a
server owns it from one engine thread.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from engine.block_manager import BlockManager
from engine.config import EngineConfig, EngineMode
from engine.contention import ThreadGovernor, schedstat_available
from engine.kv_cache import KVCache, cache_heads
from engine.loader import check_features, check_split, head_dim_of, load_config, load_model
from engine.model import layer_windows
from engine.prefix_cache import chain_hashes
from engine.request import FinishReason, Request, RequestStatus, SamplingParams, StepOutput
from engine.runner import ModelRunner, RoPE
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from engine.sequences import record_token
from engine.structured import StructuredOutputs
from engine.tensor_parallel import Shard
from engine.tiers.kv import KvTiers
from engine.tiers.offered import OfferedBlocks, PinnedRead, cut_blocks
from engine.tiers.tier import TierStats
from engine.window_pool import WindowPool

if TYPE_CHECKING:
    from engine.tp_leader import RankProcesses


@dataclass(frozen=True)
class PrefillChunk:
    """Token positions [start, end) of a request whose K/V is in the cache as of a step.

    Usually what the step computed; the first chunk computed after a prefix
    cache hit starts at 0, so that the reused prefix is sent along with it.
    """

    request_id: str
    block_ids: list[int]
    start: int
    end: int


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


LayerHook = Callable[[int, list[PrefillChunk]], None]


STEP_KINDS = ("prefill", "decode", "mixed")


@dataclass
class EngineCounters:
    """Running totals since the engine started (read them, diff two reads)."""

    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    step_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    prompt_tokens: int = 0  # computed from a prompt (recomputed ones after a preemption included)
    decode_tokens: int = 0
    preemptions: int = 0
    prefix_queries_tokens: int = 0  # tokens looked up in the prefix cache
    prefix_hits_tokens: int = 0  # of those, tokens whose K/V was reused, not computed
    tier_hits_tokens: int = 0  # of those, tokens whose K/V was loaded from a lower tier (engine/tiers/)

    def add_prefix_lookup(self, queried: int, hits: int) -> None:
        self.prefix_queries_tokens += queried
        self.prefix_hits_tokens += hits

    def add(self, plan, seconds: float) -> None:
        decode = sum(1 for c in plan.chunks if c.is_decode)
        prefill = plan.num_tokens - decode
        kind = "mixed" if prefill and decode else "prefill" if prefill else "decode"
        self.steps[kind] += 1
        self.step_seconds[kind] += seconds
        self.prompt_tokens += prefill
        self.decode_tokens += decode
        self.preemptions += len(plan.preempted)
        self.add_prefix_lookup(plan.prefix_queried, plan.prefix_hits)
        self.tier_hits_tokens += plan.tier_hits

    def copy(self) -> EngineCounters:
        return EngineCounters(
            dict(self.steps),
            dict(self.step_seconds),
            self.prompt_tokens,
            self.decode_tokens,
            self.preemptions,
            self.prefix_queries_tokens,
            self.prefix_hits_tokens,
            self.tier_hits_tokens,
        )


@dataclass(frozen=True)
class EngineStats:
    """A copy of the engine's state for readers on other threads."""

    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    counters: EngineCounters = field(default_factory=EngineCounters)
    tiers: tuple[TierStats, ...] = ()  # each KV tier's counters (engine/tiers/), host first


class LLMEngine:
    def __init__(self, config: EngineConfig, rank_module: str = "engine.tp_worker") -> None:
        """``rank_module``: what ranks 1..N-1 of a tensor-parallel engine run (engine/tp_leader.py)."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = config.torch_device
        threads = torch.get_num_threads()
        adapt = config.adapt_threads and device.type == "cpu" and config.tensor_parallel_size == 1
        # A team smaller while a neighbour takes cores (engine/contention.py).
        self.governor = (
            ThreadGovernor(threads, torch.set_num_threads) if adapt and threads > 1 and schedstat_available() else None
        )
        cfg = load_config(config.model)
        self.hf_config = cfg
        size = config.tensor_parallel_size
        shard = Shard(0, size, config.expert_parallel_size > 1)
        if size > 1:
            check_split(cfg, size, shard.expert_parallel)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        self.eos_token_ids = _eos_token_ids(config.model, cfg)
        limit = cfg.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        check_features(cfg)
        # Each layer's sliding window (None: full attention); a prefill server sends window layers' last tokens only.
        self.layer_windows: tuple[int | None, ...] = tuple(layer_windows(cfg))
        head_dim = head_dim_of(cfg)
        num_kv_heads, width, _ = cache_heads(cfg, shard, head_dim)  # this rank's: every rank holds as many
        window_layers = self._window_layers(config)  # the layers a window pool holds; () without one
        per_layer_block = KVCache.block_bytes_of(1, config.block_size, num_kv_heads, width, config.torch_dtype)
        budget = config.kv_cache_bytes - (config.window_kv_blocks or 0) * sum(window_layers) * per_layer_block
        if config.num_blocks is None and budget < per_layer_block:
            raise ValueError(
                f"window_kv_blocks {config.window_kv_blocks} take all of kv_cache_bytes {config.kv_cache_bytes}"
            )
        num_blocks = config.num_blocks or KVCache.blocks_for_bytes(
            budget,
            cfg.num_hidden_layers - sum(window_layers),
            config.block_size,
            num_kv_heads,
            width,
            config.torch_dtype,
        )
        self.ranks: RankProcesses | None = None
        self.tiers: KvTiers | None = None
        group = None
        if size > 1:
            from engine.tp_group import COLLECTIVE_TIMEOUT_S, TPGroup
            from engine.tp_leader import RankProcesses

            group = TPGroup(0, size, device, COLLECTIVE_TIMEOUT_S)
            self.ranks = RankProcesses(config, group, num_blocks, self.max_model_len, rank_module)
        try:
            self.model, _ = load_model(config.model, config.torch_dtype, device, shard, group)
            self.cache = KVCache.for_shard(
                cfg, shard, num_blocks, head_dim, config, device, window_layers, config.window_kv_blocks or 0
            )
            if self.ranks is not None:
                self.ranks.connect()
            if config.kv_tiers is not None and config.prefix_caching:
                self.tiers = KvTiers.open(config.kv_tiers, self.cache, config.cache_salt, config.model)
        except BaseException:
            self.close()
            raise
        blocks = BlockManager(num_blocks, config.block_size)
        if self.tiers is not None:
            self.tiers.watch(blocks.events)  # the router's index learns what the tiers hold
            tiers = self.tiers  # a block's tenant: the request's that computed it here (engine/tiers/kv.py)
            blocks.on_evict = lambda block_id, h: tiers.evicted(block_id, h, blocks.blocks[block_id].tenant)
            if tiers.shared:
                blocks.on_cached = lambda block_id, h: tiers.released(block_id, h, blocks.blocks[block_id].tenant)
        pool = None
        if window_layers:
            window = max(w for w in self.layer_windows if w is not None)
            pool = WindowPool(BlockManager(self.cache.num_window_blocks, config.block_size), window)
        self.scheduler = Scheduler(self._scheduler_config(config), blocks, self.tiers, pool)
        self.offered = OfferedBlocks(self.cache, self.tiers)  # the scheduler asks it only while it holds some
        rope = RoPE(cfg, head_dim, self.max_model_len, config.torch_dtype, device)
        self.runner = ModelRunner(
            self.model, self.cache, rope, device, self.eos_token_ids, self.ranks, config.attention_backend
        )
        if config.cuda_graphs:
            try:
                self.runner.use_decode_graphs(self.max_model_len, config.max_num_seqs)
            except BaseException:
                self.close()
                raise
        self.counters = EngineCounters()
        self._structured: StructuredOutputs | None = None

    # ---- requests ----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        cache_salt: str | None = None,
        generated: Sequence[int] = (),
        tenant: str | None = None,
    ) -> None:
        """Queue a request; ``cache_salt`` keeps its cached blocks apart from other salts' (tenants);
        ``tenant``: whose share of the shared KV store the blocks it computes count against (None: the
        default tenant's).

        ``generated``: a sequence that continues (a request migrated from another server): the
        tokens it already produced after ``prompt_token_ids``. They are computed with the prompt
        and start its output, as a preempted sequence's are: token i is still drawn with (seed, i),
        its grammar has taken them, and ``min_tokens`` / ``max_tokens`` count them. Only for a
        request of one sequence (``sampling.n`` 1)."""
        self.scheduler.add(self._new_request(request_id, prompt_token_ids, sampling, cache_salt, generated, tenant))

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> list[int]:
        """Decode mode: reserve blocks for a prompt whose KV another engine writes.

        The first ``num_cached_tokens(request_id)`` tokens are already in the
        returned blocks (the cached prefix, pinned for this request): only the
        rest is to be written.
        """
        request = self._new_request(request_id, prompt_token_ids, sampling, cache_salt, tenant=tenant)
        block_ids = self.scheduler.reserve(request)
        if self.config.prefix_caching and not request.wants_prompt_logprobs:
            self.counters.add_prefix_lookup(request.num_prompt_tokens, request.num_cached_tokens)
            self.counters.tier_hits_tokens += request.num_tier_tokens
        return block_ids

    def num_cached_tokens(self, request_id: str) -> int:
        """Prompt tokens a held request took from the prefix cache when it was last admitted or reserved."""
        return self.scheduler.requests[request_id][0].num_cached_tokens

    def cached_prefix(
        self, prompt_token_ids: list[int], sampling: SamplingParams | None = None, cache_salt: str | None = None
    ) -> int:
        """Tokens of this prompt a request with ``sampling`` admitted now would find cached (nothing is
        taken): none when it wants its prompt's log-probabilities."""
        probe = Request("probe", list(prompt_token_ids), sampling or SamplingParams(), cache_salt=cache_salt)
        return self.scheduler.cached_prefix_tokens(probe)

    def pin_reserved(self, request_id: str, start: int, end: int) -> PinnedRead:
        """Decode mode: pin the blocks holding tokens [start, end) of a reservation's cached prefix for a
        read by a prefill server (decode-to-prefill reuse, engine/tiers/offered.py): one more reference
        to each (``Scheduler.pin``), so that none is freed, evicted or handed out while the read's
        ``copy`` runs on another thread, even if the reservation ends meanwhile; ``unpin`` it after, on
        this engine's thread, on every path. KeyError: no reservation waiting for remote KV under that
        id; ValueError: a range past the cached prefix, or an engine split over ranks (rank 0 holds a
        slice)."""
        request = self.scheduler.parked.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"no reservation waiting for remote KV with id {request_id!r}")
        if self.ranks is not None:
            raise ValueError("an engine split over ranks holds a slice of each block on each rank")
        if not 0 <= start < end <= request.num_cached_tokens:
            raise ValueError(f"tokens [{start}, {end}) are not in the {request.num_cached_tokens} cached ones")
        bs = self.cache.block_size
        first, last = start // bs, -(-end // bs)
        block_ids = request.block_ids[first:last]
        pin_id = self.scheduler.pin(block_ids)
        return PinnedRead(pin_id, self.cache, tuple(block_ids), start - first * bs, end - first * bs)

    def unpin(self, read: PinnedRead) -> None:
        """Drop the pin ``pin_reserved`` took (once: KeyError after)."""
        self.scheduler.unpin(read.pin_id)

    def read_reserved(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """``pin_reserved``, its ``copy`` and ``unpin`` at once, on this thread: every layer's K/V of tokens
        [start, end) of a reservation's cached prefix, a CPU tensor [layers, K|V, tokens, heads, width]."""
        read = self.pin_reserved(request_id, start, end)
        try:
            return read.copy()
        finally:
            self.unpin(read)

    def offer_prefix(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        start: int,
        tokens: torch.Tensor,
        cache_salt: str | None = None,
    ) -> int:
        """Prefill mode: ``tokens`` ([layers, K|V, n, heads, width], as ``read_reserved`` gives them) hold
        the K/V of prompt tokens [start, start + n), read from another server. Its whole blocks here (the
        last prompt token always left to compute) are offered to the request ``request_id`` about to be
        added: its admission loads them instead of computing them; what is left, less than a block, is kept
        as a tail after them (engine/block_manager.py, ``keep_tail``; only where a free block holds nothing
        cached), which the admission takes too. How many tokens were offered: none
        without prefix caching, with sliding-window layers (their blocks would be registered as holding
        every position) or with ranks. ValueError: ``start`` not on a block, or a shape that is not this
        cache's. ``withdraw_prefix`` once the request is prefilled or gone."""
        bs = self.config.block_size
        if not self.config.prefix_caching or self.ranks is not None or any(w is not None for w in self.layer_windows):
            return 0
        if start % bs:
            raise ValueError(f"an offered prefix starts at token {start}, not on a block of {bs}")
        c = self.cache
        if tokens.dim() != 5 or tuple(tokens.shape[i] for i in (0, 1, 3, 4)) != (
            c.num_layers,
            2,
            c.num_kv_heads,
            c.head_dim,
        ):
            raise ValueError(f"an offered prefix of shape {tuple(tokens.shape)} does not fit this cache")
        first, end = start // bs, min((start + tokens.shape[2]) // bs, (len(prompt_token_ids) - 1) // bs)
        if end <= first:
            return 0
        hashes = chain_hashes(self.scheduler.prefix.salt, prompt_token_ids[: end * bs], bs, cache_salt)[first:]
        self.offered.offer(request_id, hashes, cut_blocks(c, tokens[:, :, : (end - first) * bs]))
        self.scheduler.tiers = self.offered
        # The rest, less than a block (the prompt's last token always left out), becomes a kept tail after the
        # offered run (engine/block_manager.py): admission takes it as the next turn takes a finished one's.
        rest = min(start + tokens.shape[2], len(prompt_token_ids) - 1) - end * bs
        blocks = self.scheduler.blocks
        if rest > 0 and blocks.num_plain_free:  # never evict a cached block for it
            part = torch.zeros((c.num_layers, 2, bs, c.num_kv_heads, c.head_dim), dtype=tokens.dtype)
            part[:, :, :rest] = tokens[:, :, (end - first) * bs : (end - first) * bs + rest]
            (block_id,) = blocks.allocate(1)
            c.kv[:, :, block_id].copy_(cut_blocks(c, part)[0])
            kept = blocks.keep_tail(block_id, hashes[-1], prompt_token_ids[end * bs : end * bs + rest])
            blocks.free([block_id])
            return (end - first) * bs + (rest if kept else 0)
        return (end - first) * bs

    def withdraw_prefix(self, request_id: str) -> None:
        """Prefill mode: forget what ``offer_prefix`` offered for ``request_id``."""
        if self.offered.withdraw(request_id) and not len(self.offered):
            self.scheduler.tiers = self.tiers

    def remote_token_problem(self, request_id: str, first_token_ids: list[int]) -> str | None:
        """Why a reserved request cannot continue from the first tokens a prefill server sent
        (one per sequence: too many or too few, outside the vocabulary, or not allowed by its
        grammar); None when it can."""
        request = self.scheduler.requests[request_id][0]
        if len(first_token_ids) != request.sampling.n:
            return f"{len(first_token_ids)} first tokens for {request.sampling.n} sequences"
        grammar = request.grammar
        for token_id in first_token_ids:
            if not 0 <= token_id < self.hf_config.vocab_size:
                return f"first token {token_id} is outside the vocabulary"
            if grammar is not None and not grammar.allows(token_id):
                return f"first token {token_id} is not allowed by the request's structured output grammar"
        return None

    def admit_remote(self, request_id: str, first_token_ids: list[int]) -> list[StepOutput]:
        """Decode mode: the prompt's KV is in the reserved blocks and its first tokens
        (one per sequence, ``sampling.n`` of them) were drawn remotely; continue decoding.
        One output per sequence, with no log-probabilities (the prefill side has them)."""
        outputs = self.scheduler.admit_remote(request_id, first_token_ids)
        self.runner.copy_blocks(self.scheduler.take_block_copies())
        return outputs

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> None:
        """Prefill mode: the held blocks of a prefilled request may be reused."""
        self.scheduler.release(request_id)

    def set_mode(self, mode: EngineMode) -> None:
        """The engine serves another role from now on (a role switch in place): a prefill engine parks
        each prompt once computed, the others generate. Weights, KV cache and prefix cache stay. Only
        while it holds no request (ValueError otherwise), and not with tensor-parallel ranks, which
        hold their own transfer agents for the role they started in (ValueError)."""
        if self.ranks is not None:
            raise ValueError("a tensor-parallel engine keeps the role it started in")
        if self.scheduler.window_pool is not None and mode != "colocated":
            raise ValueError("window_kv_blocks serve colocated only: a transfer addresses one block table")
        if self.scheduler.requests:
            raise ValueError(f"the engine still holds {len(self.scheduler.requests)} requests")
        self.config = dataclasses.replace(self.config, mode=mode)
        self.scheduler.config = dataclasses.replace(self.scheduler.config, mode=mode)

    def rank_problem(self) -> str | None:
        """Why a tensor-parallel engine cannot compute (one of its ranks exited); None otherwise.
        Safe from any thread."""
        return None if self.ranks is None else self.ranks.problem()

    def _window_layers(self, config: EngineConfig) -> tuple[bool, ...]:
        """Which layers a window pool holds (``window_kv_blocks``, engine/window_pool.py): the window layers of a
        model mixing them with full-attention layers; () without ``window_kv_blocks``. ValueError for a model
        that mixes nothing, or too few blocks for one sequence's largest step."""
        if config.window_kv_blocks is None:
            return ()
        windows = [w for w in self.layer_windows if w is not None]
        if not windows or len(windows) == len(self.layer_windows):
            raise ValueError(
                f"window_kv_blocks is for a model mixing sliding-window and full-attention layers; {config.model} "
                f"has {len(windows)} window layers of {len(self.layer_windows)}"
            )
        bs = config.block_size
        # A step computes at most max_num_batched_tokens of a sequence, reading from its window's first key.
        least = min(-(-(max(windows) - 1 + config.max_num_batched_tokens) // bs) + 1, -(-self.max_model_len // bs))
        if config.window_kv_blocks < least:
            raise ValueError(
                f"window_kv_blocks {config.window_kv_blocks} is fewer than one sequence's step may hold ({least}: "
                f"a window of {max(windows)} and max_num_batched_tokens {config.max_num_batched_tokens} "
                f"in blocks of {bs})"
            )
        return tuple(w is not None for w in self.layer_windows)

    def sequence_kv_bytes(self, num_tokens: int) -> int:
        """K and V bytes a decoding sequence of ``num_tokens`` tokens holds: a block of every layer for each
        ``block_size`` tokens, or with a window pool, of the full-attention layers for each and of the window
        layers only for those its next query reads."""
        blocks = self.scheduler.blocks.blocks_needed(num_tokens)
        pool = self.scheduler.window_pool
        if pool is None:
            return blocks * self.cache.bytes_per_block
        return blocks * self.cache.bytes_per_block + (blocks - pool.first_block(num_tokens - 1)) * (
            self.cache.bytes_per_window_block
        )

    def _scheduler_config(self, config: EngineConfig) -> SchedulerConfig:
        """The scheduler's settings: the engine's, with its context length, end tokens and layer windows
        (``max_model_len``, ``eos_token_ids`` and ``layer_windows`` set before)."""
        windows = [w for w in self.layer_windows if w is not None]
        return SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            chunked_prefill=config.chunked_prefill,
            max_model_len=self.max_model_len,
            mode=config.mode,
            eos_token_ids=self.eos_token_ids,
            prefix_caching=config.prefix_caching,
            cache_salt=config.cache_salt,
            window=max(windows) if windows else None,
            release_window=max(windows) if windows and len(windows) == len(self.layer_windows) else None,
        )

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel engine and the KV tiers' writers (after their
        queued writes)."""
        if self.tiers is not None:
            self.tiers.close()
        if self.ranks is not None:
            self.ranks.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def block_counts(self) -> dict[str, int]:
        return self.scheduler.block_counts()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> EngineStats:
        """What /health and /metrics show: blocks by state, queues, step counters (a copy)."""
        tiers = () if self.tiers is None else self.tiers.stats()
        return EngineStats(self.scheduler.stats(), self.counters.copy(), tiers)

    # ---- stepping ----------------------------------------------------------
    def step(self, layer_hook: LayerHook | None = None) -> list[StepOutput]:
        """One step. ``layer_hook(layer, chunks)`` is called as soon as each
        layer's K/V of the step's prompt chunks is in the cache (a prefill
        server pushes it to the decode server from there)."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            self.counters.preemptions += len(plan.preempted)
            return []
        t0 = time.perf_counter()
        tokens = self.runner.run(plan, None if layer_hook is None else self._layer_callback(plan, layer_hook))
        outputs = self.scheduler.update(plan, tokens)
        self.runner.copy_blocks(self.scheduler.take_block_copies())  # forks' blocks, before anyone writes there
        self.counters.add(plan, time.perf_counter() - t0)
        if self.governor is not None:
            self.governor.after_step()
        return outputs

    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        """Offline generation of a batch of prompts (text or token ids): ``sampling.n``
        results per prompt, prompt by prompt."""
        ids = [f"generate-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            tokens = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
            self.add_request(request_id, tokens, sampling)
        keys = [(i, index) for i in ids for index in range(sampling.n)]
        outputs: dict[tuple[str, int], list[int]] = {key: [] for key in keys}
        reasons: dict[tuple[str, int], str] = {}
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id, out.index] += out.new_token_ids
                if out.finished:
                    reasons[out.request_id, out.index] = out.finish_reason
        return [
            GenerationResult(outputs[k], self.tokenizer.decode(outputs[k], skip_special_tokens=True), reasons[k])
            for k in keys
        ]

    # ---- helpers ---------------------------------------------------------------
    def _new_request(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        cache_salt: str | None = None,
        generated: Sequence[int] = (),
        tenant: str | None = None,
    ) -> Request:
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.hf_config.vocab_size
        bad = [t for t in (*prompt, *generated) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        if generated:
            if sampling.n != 1:
                raise ValueError("generated tokens continue one sequence: sampling.n must be 1")
            if len(generated) >= sampling.max_tokens:
                raise ValueError(
                    f"{len(generated)} generated tokens leave nothing to generate (max_tokens {sampling.max_tokens})"
                )
        named = [t for t, _ in sampling.logit_bias] + list(sampling.stop_token_ids)
        bad = [t for t in named if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias or stop_token_ids name token ids {bad[:5]} outside the vocabulary")
        if len(prompt) + len(generated) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt) + len(generated)} tokens; the context holds {self.max_model_len} "
                "including at least one generated token"
            )
        blocks = self.scheduler.blocks
        needed = blocks.blocks_needed(len(prompt) + len(generated) + 1)
        if needed > blocks.num_blocks:  # it could never be admitted, and would hold up the queue behind it
            raise ValueError(
                f"the prompt has {len(prompt) + len(generated)} tokens; with its first generated token they need "
                f"{needed} KV blocks, and this server's cache holds {blocks.num_blocks}"
            )
        if self.config.mode != "prefill":  # here it also generates: each sequence must fit the cache alone
            most = min(sampling.max_tokens, self.max_model_len - len(prompt))
            needed = blocks.blocks_needed(len(prompt) + most)
            if needed > blocks.num_blocks:  # grown past the cache, it would preempt itself for good
                raise ValueError(
                    f"the prompt ({len(prompt)} tokens) and up to {most} generated tokens need "
                    f"{needed} KV blocks; this server's cache holds {blocks.num_blocks}"
                )
        grammar = None if sampling.structured is None else self._structured_outputs().grammar(sampling.structured)
        request = Request(request_id, list(prompt), sampling, cache_salt=cache_salt, tenant=tenant, grammar=grammar)
        for position, token in enumerate(generated):
            if record_token(request, token, self.eos_token_ids, self.max_model_len) is not None:
                raise ValueError(f"generated token {position} ({token}) ends the sequence: nothing is left to generate")
        return request

    def _structured_outputs(self) -> StructuredOutputs:
        """Built on the first request with a grammar (about a second for a large vocabulary), then kept."""
        if self._structured is None:
            self._structured = StructuredOutputs(
                self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids, self.config.num_threads
            )
        return self._structured

    @staticmethod
    def _layer_callback(plan, hook: LayerHook) -> Callable[[int], None]:
        chunks = [
            PrefillChunk(
                c.request.request_id,
                list(c.request.block_ids),
                0 if c.start == c.request.num_cached_tokens else c.start,
                c.start + c.num_tokens,
            )
            for c in plan.chunks
        ]
        return lambda layer: hook(layer, chunks)


def _eos_token_ids(model_dir: str, hf_config) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (getattr(hf_config, "eos_token_id", None), _generation_eos(model_dir)):
        if value is None:
            continue
        ids += value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(ids))


def _generation_eos(model_dir: str):
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("eos_token_id")
