"""Scheduler test helpers: a scheduler on its own block manager, requests, and the runner's side of a step."""

from engine.block_manager import BlockManager
from engine.request import ChunkResult, Request, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

EOS = 99


def make(
    num_blocks=8, block_size=4, budget=64, max_seqs=8, chunked=True, mode="colocated", max_len=64, prefix_caching=True
):
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        max_model_len=max_len,
        mode=mode,
        eos_token_ids=(EOS,),
        prefix_caching=prefix_caching,
        cache_salt="model|float32",
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


def update(s, plan, tokens: dict[str, int]):
    """``s.update`` with the runner's result for a plan: ``tokens[request id]`` drawn for each sampling chunk."""
    return s.update(plan, {c.request: ChunkResult([tokens[c.request.request_id]]) for c in plan.chunks if c.sample})


def plan_shape(plan):
    return [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks]


def req(rid, tokens, max_tokens=8, salt=None):
    return Request(
        rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), cache_salt=salt
    )


def run_to_end(s, token=7):
    while s.has_unfinished():
        plan = s.schedule()
        update(s, plan, {c.request.request_id: token for c in plan.chunks if c.sample})
        s.check_integrity()
