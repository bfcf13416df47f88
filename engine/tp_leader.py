"""Rank 0's side of a tensor-parallel engine: it starts, drives and stops ranks 1..N-1.

Rank 0 is the engine itself, in the server process (docs/architecture.md,
"Tensor parallelism"): it schedules, builds each step's ``StepInputs`` and
broadcasts them, computes its own shard, and samples from the logits the
group gathers to it. The other ranks are child processes
(engine/tp_worker.py) whose stdin is a pipe from rank 0: their spec and
each step's header go down it, and its EOF, when rank 0 closes it or its
process ends for any reason, ends them.

A rank may also hold an agent (``engine.tp_worker.Agent``: a prefill
server's ranks hold their KV sender, kvlink/agent.py). Rank 0
writes it messages down the same pipe (``send_message``, between steps, in
order with them) and reads what it answers from a second pipe, one JSON
line each (``listen``).

A rank that exits is a dead engine: ``problem()`` says so (the servers'
/health and watchdog read it, server_common/vitals.py, and the process exits
for its supervisor to restart the whole instance), and the step that was
running fails in its collective.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig
from engine.tp_group import COLLECTIVE_TIMEOUT_S, TPGroup, ready_key, store_for
from engine.tp_wire import HEADER, OP_MESSAGE, OP_STEP, StepInputs, encode

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # where `python -m engine.tp_worker` finds engine
START_TIMEOUT_S = 600.0  # every rank loads its shard within this (a large model from a slow disk)
STOP_TIMEOUT_S = 10.0


class RankStartError(RuntimeError):
    """A rank exited, or did not load its shard in time, before the group was built."""


class RankProcesses:
    """Ranks 1..N-1 as child processes, and rank 0's end of their group."""

    def __init__(
        self,
        config: EngineConfig,
        group: TPGroup,
        num_blocks: int,
        max_model_len: int,
        rank_module: str = "engine.tp_worker",
    ) -> None:
        """``rank_module``: what each rank runs (``python -m``): engine.tp_worker, or a module that
        runs its ``main`` with an agent."""
        self.group = group
        self.size = group.size
        prefix = secrets.token_hex(16) + "/"
        self._store, port = store_for(0, prefix, self.size, COLLECTIVE_TIMEOUT_S, leader=True)
        self.procs: list[subprocess.Popen] = []
        self._replies: list[int] = []  # read ends of the ranks' answer pipes
        self._write_lock = threading.Lock()  # steps (engine thread) and messages (any thread) share the pipes
        spec = {
            "config": dataclasses.asdict(config),
            "size": self.size,
            "num_blocks": num_blocks,
            "max_model_len": max_model_len,
            "store_port": port,
            "prefix": prefix,
        }
        path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        try:
            for rank in range(1, self.size):
                read, write = os.pipe()
                self._replies.append(read)
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", rank_module], stdin=subprocess.PIPE, env=env, pass_fds=(write,)
                    )
                finally:
                    os.close(write)
                self.procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({**spec, "rank": rank, "reply_fd": write}).encode() + b"\n")
                proc.stdin.flush()
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def connect(self) -> None:
        """Waits until every rank loaded its shard, then builds the group; raises ``RankStartError``
        (the ranks stopped) when one exits first or takes longer than ``START_TIMEOUT_S``."""
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for rank, proc in enumerate(self.procs, start=1):
                while not self._store.check([ready_key(rank)]):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RankStartError(f"tensor-parallel rank {rank} did not load its shard in time")
                    try:
                        code = proc.wait(timeout=min(0.1, left))  # a wait on the rank's exit, not a nap
                    except subprocess.TimeoutExpired:
                        continue
                    raise RankStartError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}")
            self.group.connect(self._store)
        except BaseException:
            self.close()
            raise

    def send_step(self, inputs: StepInputs) -> None:
        payload = encode(inputs)
        header = HEADER.pack(OP_STEP, payload.numel())
        with self._write_lock:
            for proc in self.procs:  # a rank that died raises BrokenPipeError here: the step fails
                assert proc.stdin is not None
                proc.stdin.write(header)
                proc.stdin.flush()
        self.group.broadcast(payload)

    def send_message(self, rank: int, message: dict) -> None:
        """A message for rank ``rank``'s agent (1..N-1); it is handled after the steps sent before
        it. Raises BrokenPipeError when the rank is gone. Any thread."""
        body = json.dumps(message).encode()
        proc = self.procs[rank - 1]
        assert proc.stdin is not None
        with self._write_lock:
            proc.stdin.write(HEADER.pack(OP_MESSAGE, len(body)) + body)
            proc.stdin.flush()

    def listen(self, on_message: Callable[[int, dict], None]) -> None:
        """Calls ``on_message(rank, message)`` for every line a rank's agent answers, on one thread
        per rank, until the rank's end of its pipe closes (the rank exited)."""

        def read(rank: int, fd: int) -> None:
            with os.fdopen(fd, "rb") as pipe:  # the reader owns the descriptor from here
                for line in pipe:
                    on_message(rank, json.loads(line))

        replies, self._replies = self._replies, []
        for rank, fd in enumerate(replies, start=1):
            threading.Thread(target=read, args=(rank, fd), name=f"tp-rank-{rank}-answers", daemon=True).start()

    def problem(self) -> str | None:
        """Why the group cannot compute (a rank exited); None while every rank lives. Any thread."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}"
        return None

    def close(self) -> None:
        """Stops every rank: closes their stdin (they exit at its EOF) and kills one that is still
        there after ``STOP_TIMEOUT_S``."""
        for proc in self.procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except BrokenPipeError:  # it is gone already
                    pass
        self.group.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        # pipes nobody listens to (a listener closes its own at the EOF its rank's exit brings)
        replies, self._replies = self._replies, []
        for fd in replies:
            os.close(fd)
