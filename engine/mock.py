"""A simulated engine for clusters at scale: the real scheduler, block manager and prefix cache, no model.

``MockEngine`` is an ``LLMEngine`` whose runner computes nothing. A step is
scheduled and accounted exactly as a real one (``LLMEngine.step``: the same
plan, preemptions, prefix hits, block copies and outputs); only the runner
differs (``MockRunner``):

* its tokens come from a hash of the sequence (its last token, its length,
  the request's seed and the draw), never an end-of-sequence or stop token,
  so a request runs to ``max_tokens`` and the same request gives the same
  tokens on every run, split over a prefill and a decode server or not;
* it sleeps the step's modelled time: the step-cost model of
  ``pdserve plan``'s profile (bench/plan/costmodel.py, read from its JSON
  by engine/step_cost.py), or ``DEFAULT_STEP_COST`` when none is given.

No weights are loaded (the model folder's config.json sizes the vocabulary,
the context and the number of blocks ``kv_cache_bytes`` holds for the real
model). The KV cache is one layer of one head of width 1: a transfer between
a mock prefill and a mock decode server runs the real sender, receiver,
notices, checksums and leases over 2 values a token. A mock server and a
model server refuse each other at the transfer handshake (their layouts
differ). Structured outputs are refused: hashed tokens follow no grammar.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.engine import EngineCounters, LLMEngine, _eos_token_ids
from engine.kv_cache import KVCache, cache_heads
from engine.loader import head_dim_of, load_config
from engine.request import LOGPROB_FLOOR, ChunkResult, Logprob, Request
from engine.scheduler import SchedulePlan, Scheduler
from engine.step_cost import DEFAULT_STEP_COST, StepCost, chunk_attn_pairs, load_step_cost
from engine.tensor_parallel import Shard
from engine.tiers.offered import OfferedBlocks

_MASK = (1 << 64) - 1


def plan_time(cost: StepCost, plan: SchedulePlan) -> float:
    """The modelled seconds of one scheduled step: every chunk's tokens, each prompt chunk's attention
    pairs (causal from position 0, else masked over every key), one sequence per sampling chunk, and
    each decode's context read (without the padding of decode groups)."""
    new_tokens = attn_pairs = seqs = keys = 0
    for chunk in plan.chunks:
        start, end = chunk.start, chunk.start + chunk.num_tokens
        new_tokens += chunk.num_tokens
        seqs += chunk.sample
        if chunk.num_tokens == 1 and start > 0:
            keys += end
        else:
            attn_pairs += chunk_attn_pairs(start, end)
    return cost.step_time(new_tokens, attn_pairs, seqs, keys)


def mock_token(last: int, length: int, seed: int, draw: int, vocab: int, banned: frozenset[int]) -> int:
    """The token after a sequence whose last token is ``last`` and whose length is ``length`` (splitmix64
    of the four numbers), never one of ``banned``."""
    x = last * 0x9E3779B97F4A7C15 + length * 0xBF58476D1CE4E5B9 + (seed * 1_000_003 + draw) * 0x94D049BB133111EB
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    token = (x ^ (x >> 31)) % vocab
    while token in banned:
        token = (token + 1) % vocab
    return token


class MockRunner:
    """A runner that computes nothing: hashed tokens, the step's modelled time slept (see the module)."""

    def __init__(
        self,
        cost: StepCost,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cost = cost
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.modelled_seconds = 0.0  # the sum of every step's modelled time
        self._stop = threading.Event()  # set by close(): a step in its sleep ends it

    def run(self, plan: SchedulePlan, on_layer: Callable[[int], None] | None = None) -> dict[Request, ChunkResult]:
        """What ``ModelRunner.run`` returns for the plan, after the plan's modelled time since the call."""
        start = self.clock()
        seconds = plan_time(self.cost, plan)
        self.modelled_seconds += seconds
        results = {}
        for chunk in plan.chunks:
            request = chunk.request
            prompt = self._prompt_logprobs(request, chunk.start, chunk.num_tokens, chunk.sample)
            if not chunk.sample:
                if prompt is not None:
                    results[request] = ChunkResult(prompt_logprobs=prompt)
                continue
            tokens = self._draw(request, chunk.start + chunk.num_tokens)
            k = request.sampling.logprobs
            logprobs = None if k is None else [self._logprob(t, k) for t in tokens]
            results[request] = ChunkResult(tokens, logprobs, prompt)
        left = start + seconds - self.clock()
        if left > 0:
            self._stop.wait(left)
        if on_layer is not None:
            on_layer(0)  # the mock cache has one layer: it is "computed" at the end of the step
        return results

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Nothing to copy: the mock cache's bytes mean nothing."""

    def close(self) -> None:
        self._stop.set()

    def _draw(self, request: Request, end: int) -> list[int]:
        """The tokens a sampling chunk ending at ``end`` draws: n for a request's first, else one."""
        sampling = request.sampling
        banned = self.eos_token_ids | frozenset(sampling.stop_token_ids)
        last = request.token_ids(end - 1, end)[0]
        seed = sampling.seed or 0
        return [mock_token(last, end, seed, j, self.vocab_size, banned) for j in range(request.draws_first_tokens)]

    def _prompt_logprobs(self, request: Request, start: int, n: int, sample: bool) -> list[Logprob | None] | None:
        """A chunk's prompt entries, as ``ModelRunner`` gives them (None first for position 0)."""
        if not request.wants_prompt_logprobs:
            return None
        k = request.sampling.prompt_logprobs or 0
        targets = request.token_ids(start + 1, start + n if sample else start + n + 1)
        return ([None] if start == 0 else []) + [self._logprob(t, k) for t in targets]

    def _logprob(self, token: int, k: int) -> Logprob:
        """Certainty: the token at log-probability 0, then k - 1 others at the floor."""
        top = [(token, 0.0)] + [((token + i) % self.vocab_size, LOGPROB_FLOOR) for i in range(1, k)]
        return Logprob(0.0, tuple(top[:k]))


class MockEngine(LLMEngine):
    """An ``LLMEngine`` with ``MockRunner`` in place of the model (see the module)."""

    def __init__(self, config: EngineConfig, rank_module: str = "engine.tp_worker") -> None:
        """``rank_module`` is accepted as ``LLMEngine`` takes it; a mock engine has one rank."""
        self.config = config
        if config.num_threads is not None:  # the transfer's copies of the small cache run on them
            torch.set_num_threads(config.num_threads)
        cfg = load_config(config.model)
        self.hf_config = cfg
        self.eos_token_ids = _eos_token_ids(config.model, cfg)
        limit = cfg.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.layer_windows = (None,)
        heads, width, _ = cache_heads(cfg, Shard(), head_dim_of(cfg))
        num_blocks = config.num_blocks or KVCache.blocks_for_bytes(
            config.kv_cache_bytes, cfg.num_hidden_layers, config.block_size, heads, width, config.torch_dtype
        )  # as many blocks as the real model's cache would hold
        cpu = torch.device("cpu")
        self.cache = KVCache(1, num_blocks, config.block_size, 1, 1, config.torch_dtype, cpu, config.kv_layout)
        self.ranks = None
        self.tiers = None
        self.offered = OfferedBlocks(self.cache, self.tiers)  # a prefix read from a decode server, as LLMEngine's
        self.governor = None  # it computes nothing: no team to size
        self.scheduler = Scheduler(self._scheduler_config(config), BlockManager(num_blocks, config.block_size))
        profile = config.mock_profile
        cost = DEFAULT_STEP_COST if profile is None else load_step_cost(profile, config.num_threads)
        self.runner = MockRunner(cost, cfg.vocab_size, self.eos_token_ids)  # type: ignore[assignment]
        self.counters = EngineCounters()
        self._structured = None
        self._tokenizer = None

    @property  # type: ignore[override]
    def tokenizer(self):
        """The model folder's tokenizer, loaded on first use (``generate``): the servers never need it."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model, local_files_only=True)
        return self._tokenizer

    def close(self) -> None:
        self.runner.close()

    def _new_request(self, request_id, prompt, sampling, cache_salt=None, generated=(), tenant=None) -> Request:
        if sampling.structured is not None:
            raise ValueError("a mock engine does not follow structured outputs: its tokens are hashed")
        return super()._new_request(request_id, prompt, sampling, cache_salt, generated, tenant)
