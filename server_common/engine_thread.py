"""Runs an LLMEngine on one dedicated thread so HTTP never waits on a step.

The engine is not thread-safe, so everything that touches it runs on this
thread: other threads (the event loop, the transfer layer's thread) submit
closures with ``call`` and get a ``concurrent.futures.Future``. Between two
steps the thread runs every closure submitted so far, so an abort is applied
before the next step. Each step's outputs go to ``on_outputs``, called on the
engine thread. After every iteration the thread publishes a ``Snapshot`` that
/health and /metrics read without touching the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine import LLMEngine, StepOutput
from engine.engine import EngineCounters

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class Snapshot:
    free: int = 0
    reserved: int = 0
    running: int = 0
    queue_depth: int = 0  # requests waiting to be scheduled
    queued_tokens: int = 0  # prompt tokens not computed yet
    num_requests: int = 0  # requests the engine holds in any state
    total: int = 0  # blocks in the cache
    # (state, arrival time.monotonic(), blocks) of every request holding blocks; state: reserved | running
    holders: tuple[tuple[str, float, int], ...] = ()
    counters: EngineCounters = field(default_factory=EngineCounters)  # steps, their seconds, preemptions


def take_snapshot(engine: LLMEngine) -> Snapshot:
    counts = engine.block_counts()
    sched = engine.scheduler
    pending = [*sched.waiting, *sched.running]
    return Snapshot(
        free=counts["free"], reserved=counts["reserved"], running=counts["running"],
        queue_depth=len(sched.waiting),
        queued_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed) for r in pending),
        num_requests=len(sched.requests),
        total=sched.blocks.num_blocks,
        holders=tuple(("reserved" if r.request_id in sched.parked else "running", r.arrival_time, len(r.block_ids))
                      for r in sched.requests.values() if r.block_ids),
        counters=engine.counters.copy(),
    )


class EngineThread:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[StepOutput]], None], name: str) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._calls: queue.Queue[tuple[Callable[[LLMEngine], Any], Future]] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self.snapshot = take_snapshot(engine)
        self.error: BaseException | None = None  # set if a step failed: the server is broken
        self.last_round = time.monotonic()  # when the loop last went round (between two steps at most)
        self._stepping = False  # inside engine.step()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def problem(self, stuck_after_s: float) -> str | None:
        """Why the engine cannot serve: its thread died, or it has work and went
        no round (one step at most) for ``stuck_after_s``; None when it works."""
        if self._thread.ident is not None and not self.alive and not self._stopping.is_set():
            return f"engine thread died: {self.error!r}"
        stalled = time.monotonic() - self.last_round
        if stalled > stuck_after_s and (self._stepping or self.snapshot.num_requests or not self._calls.empty()):
            return f"engine thread made no progress for {stalled:.0f} s with work queued"
        return None

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps."""
        fut: Future[T] = Future()
        if not self.alive and self._thread.ident is not None:
            fut.set_exception(RuntimeError(f"engine thread is not running: {self.error!r}"))
            return fut
        self._calls.put((fn, fut))
        if self._thread.ident is not None and not self._thread.is_alive():
            self._fail_pending()  # it died between the check and the put
        return fut

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """``call`` for the event loop."""
        return await asyncio.wrap_future(self.call(fn))

    def _run_calls(self, block: bool) -> None:
        try:
            fn, fut = self._calls.get(timeout=IDLE_WAIT_S) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # handed to the caller, who decides
                    fut.set_exception(exc)
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_calls(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._stepping = True
                    outputs = self.engine.step()
                    self._stepping = False
                    if outputs:
                        self._on_outputs(outputs)
                self.snapshot = take_snapshot(self.engine)
                self.last_round = time.monotonic()
        except BaseException as exc:
            log.exception("engine thread died")
            self.error = exc
        finally:
            self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("engine thread stopped"))
