"""The process group of a tensor-parallel engine's ranks: gloo on CPU, NCCL on CUDA.

Rank 0 (the server process) opens a ``TCPStore`` on 127.0.0.1 on a port the
system picks and hands its port and a random prefix to the other ranks over
their stdin (engine/tp_leader.py); every key of the rendezvous is under that
prefix, so a process that connects to the store without it cannot take a
rank's place. The group is built on the store with its own options (no
default process group: two engines in one process do not share anything),
its devices bound to 127.0.0.1, and a timeout on every collective so that a
rank that stops answering fails the step instead of hanging it.

The NCCL branch is the same code with ``ProcessGroupNCCL``; it has not run on
a CUDA device yet.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
# A collective waits this long for the other ranks at most: they compute the same step, so this is
# their skew, not a step's length. Idle ranks wait on their pipe, not in a collective.
COLLECTIVE_TIMEOUT_S = 60.0


def ready_key(rank: int) -> str:
    """Set by a rank once its shard is loaded (rank 0 waits for every one before building the group)."""
    return f"ready/{rank}"


class TPGroup:
    """One rank's end of the group: the model's collectives (``engine.model.RankGroup``) and the
    step broadcast; it counts the seconds spent in the model's collectives."""

    def __init__(self, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pg: dist.ProcessGroup | None = None
        self.collective_seconds = 0.0  # in all_reduce and gather_logits, since the start

    def connect(self, store: dist.Store) -> None:
        """Joins the group (blocks until every rank joined, or the timeout)."""
        if self.device.type == "cuda":  # the same code path as gloo's; unverified until it runs on a device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._pg = dist.ProcessGroupNCCL(store, self.rank, self.size, options)
        else:
            gloo = dist.ProcessGroupGloo._Options()
            gloo._timeout = self.timeout
            gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.size, gloo)

    @property
    def connected(self) -> bool:
        return self._pg is not None

    @property
    def pg(self) -> dist.ProcessGroup:
        assert self._pg is not None, "the group is not connected"
        return self._pg

    def all_reduce(self, x: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.pg.allreduce([x]).wait()
        self.collective_seconds += time.perf_counter() - t0

    def gather_logits(self, part: torch.Tensor) -> torch.Tensor | None:
        if part.shape[0] == 0:  # every rank knows the row count: nobody sends anything
            return part.new_empty((0, part.shape[1] * self.size)) if self.rank == 0 else None
        t0 = time.perf_counter()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank == 0:
            parts = [[torch.empty_like(part) for _ in range(self.size)]]
            self.pg.gather(parts, [part], options).wait()
            out: torch.Tensor | None = torch.cat(parts[0], dim=1)
        else:
            self.pg.gather([], [part], options).wait()
            out = None
        self.collective_seconds += time.perf_counter() - t0
        return out

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (in place on the device; returned on the CPU)."""
        on_device = tensor.to(self.device)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([on_device], options).wait()
        return on_device.cpu()

    def close(self) -> None:
        if self._pg is not None and self.device.type == "cuda":
            self._pg.shutdown()
        self._pg = None


def store_for(port: int, prefix: str, size: int, timeout_s: float, *, leader: bool) -> tuple[dist.Store, int]:
    """The rendezvous store under ``prefix`` and its port: rank 0 opens it (``port`` 0: the system
    picks one), the others join it."""
    store = dist.TCPStore(
        LOOPBACK, port, size, leader, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return dist.PrefixStore(prefix, store), store.port
