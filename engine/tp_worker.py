"""A rank other than 0 of a tensor-parallel engine: ``python -m engine.tp_worker``.

Started by rank 0 (engine/tp_leader.py), which writes one JSON line to its
stdin: the ``EngineConfig``, its rank, the cache's block count, the context
length and the rendezvous (store port and key prefix, which is why it does not
travel on the command line). The rank loads its shard, allocates its slice
of the KV cache (its KV heads, every block), says it is ready, joins the
group, then runs every step rank 0 broadcasts until rank 0 says stop.

It holds no scheduler, no block manager and no tokenizer: block ids come in
each step's inputs, so its cache slice has the same block table as rank 0's.
Between steps it waits on its stdin for the next step's header (so an idle
engine has no collective pending, and collectives keep a short timeout); the
payload comes by broadcast. A message for its agent (``Agent``: what a server
adds to a rank, e.g. kvlink/agent.py's KV sender) comes down the
same pipe between steps; the agent answers on the pipe whose descriptor the
spec names (``reply_fd``), one JSON line each. It ends when rank 0 goes, however it goes: stdin
reaches EOF when rank 0's process ends, and a collective fails when a peer's
connection closes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.loader import head_dim_of, load_model
from engine.runner import ModelRunner, RoPE
from engine.tensor_parallel import Shard
from engine.tp_group import COLLECTIVE_TIMEOUT_S, TPGroup, ready_key, store_for
from engine.tp_wire import HEADER, OP_MESSAGE, OP_STEP, decode

log = logging.getLogger("pdserve.tp_worker")
EXIT_LEADER_GONE = 0  # nothing to report: rank 0 ended

Reply = Callable[[dict], None]  # sends one JSON-ready message to rank 0; any thread
Agent = Callable[[dict], None]  # handles one message from rank 0, on the rank's main thread, between steps
# Builds a rank's agent from its spec, its KV cache slice and its reply channel.
AgentFactory = Callable[[dict, KVCache, Reply], Agent]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU for every rank, or the r-th CUDA device after the configured one."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def reply_channel(fd: int) -> Reply:
    """One JSON line per message on the pipe to rank 0 (a lock keeps lines whole across threads)."""
    pipe = os.fdopen(fd, "wb")
    lock = threading.Lock()

    def reply(message: dict) -> None:
        line = json.dumps(message).encode() + b"\n"
        with lock:
            pipe.write(line)
            pipe.flush()

    return reply


def main(make_agent: AgentFactory | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pipe = sys.stdin.buffer
    spec = json.loads(pipe.readline())
    config = EngineConfig(**spec["config"])
    rank, size = int(spec["rank"]), int(spec["size"])
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = rank_device(config.torch_device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shard = Shard(rank, size, config.expert_parallel_size > 1)
    group = TPGroup(rank, size, device, COLLECTIVE_TIMEOUT_S)
    model, cfg = load_model(config.model, config.torch_dtype, device, shard, group)
    head_dim = head_dim_of(cfg)
    cache = KVCache.for_shard(cfg, shard, int(spec["num_blocks"]), head_dim, config, device)
    rope = RoPE(cfg, head_dim, int(spec["max_model_len"]), config.torch_dtype, device)
    runner = ModelRunner(model, cache, rope, device, attention_backend=config.attention_backend)
    agent = make_agent(spec, cache, reply_channel(int(spec["reply_fd"]))) if make_agent is not None else None
    store, _ = store_for(int(spec["store_port"]), spec["prefix"], size, COLLECTIVE_TIMEOUT_S, leader=False)
    store.set(ready_key(rank), "1")
    group.connect(store)
    log.info("tensor-parallel rank %d of %d ready (pid %d)", rank, size, os.getpid())
    with torch.inference_mode():
        while True:
            header = pipe.read(HEADER.size)
            if len(header) < HEADER.size:  # EOF: rank 0 stopped us or its process ended
                break
            op, length = HEADER.unpack(header)
            if op == OP_MESSAGE:
                message = json.loads(pipe.read(length))
                if agent is None:
                    raise RuntimeError(f"rank {rank} has no agent for the message {message.get('op')!r}")
                agent(message)
                continue
            assert op == OP_STEP, op
            runner.forward(decode(group.broadcast(torch.empty(length, dtype=torch.long))))
    group.close()
    return EXIT_LEADER_GONE


if __name__ == "__main__":
    sys.exit(main())
