"""Runs an LLMEngine on one dedicated thread so HTTP never waits on a step.

The engine is not thread-safe, so everything that touches it runs on this
thread: other threads (the event loop) submit closures with ``call`` and get
a ``concurrent.futures.Future``. Between two steps the thread runs every
closure submitted so far (so an abort is applied before the next step), then
``between_steps(engine)``: the server takes the transfers that ended from its
KV sender or receiver there, so a finished transfer crosses one thread
boundary (transfer thread -> engine thread). The transfer thread calls
``wake()`` when one ends: with nothing to run the thread sleeps on its call
queue until a call or a wake arrives (``stop`` sends one too), so an idle
server costs no CPU.
Each step's outputs go to ``on_outputs(engine, outputs)``, on the engine thread; a
prefill server's ``layer_hook`` sees each layer's K/V as soon as it is
computed. After every iteration the thread publishes an ``EngineStats``
copy that /health and /metrics read as ``stats`` without touching the
engine. A prompt handed with ``call(..., prompt_tokens=n)`` counts in
``stats`` as waiting (``queue_depth`` and ``queued_tokens``) from the call
until the first copy taken after it ran: prompts that arrive during a step
wait in the call queue, and a copy taken after the step would not show them
(the planner would read a prefill server's backlog as nothing).

``build_engine`` builds the engine on a short-lived thread, never on the thread
that later serves HTTP (see its docstring).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from engine import EngineConfig, EngineStats, LLMEngine, StepOutput
from engine.engine import LayerHook

log = logging.getLogger(__name__)
T = TypeVar("T")
_WAKE = (None, None, None)  # a queue item that only ends the idle wait
# The engine thread compiles requests' grammars, and llguidance compiles recursively in native code
# (engine/structured.py: GRAMMAR_CEILING is what fits 8 MiB with room to spare). Its stack is set here
# rather than inherited from `ulimit -s`, which differs between hosts and containers. Address space
# only: pages are committed as they are touched.
ENGINE_STACK_BYTES = 64 << 20


def build_engine(config: EngineConfig, rank_module: str | None = None) -> LLMEngine:
    """``LLMEngine(config, rank_module=...)`` built on a thread that exits once it is built (a mock engine,
    ``engine.kind: mock``, computes nothing and is built here).

    Loading runs torch's CPU kernels, and OpenMP gives every thread that runs them a team of
    worker threads of its own, kept as long as that thread lives. Built on the main thread
    (which then serves HTTP and lives on), the engine thread's team would come second: more
    OpenMP threads than cores, and OpenMP then stops spinning between kernels and sleeps
    instead, which costs a wake-up per kernel, about a third of a CPU decode step.
    """
    if config.kind == "mock":  # no model, no torch kernels: engine/mock.py
        from engine.mock import MockEngine

        return MockEngine(config)
    with ThreadPoolExecutor(1, thread_name_prefix="engine-build") as pool:
        return pool.submit(LLMEngine, config, rank_module=rank_module).result()


class EngineThread:
    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[LLMEngine, list[StepOutput]], None],
        name: str,
        *,
        between_steps: Callable[[LLMEngine], None] | None = None,
        layer_hook: LayerHook | None = None,
    ) -> None:
        self._engine = engine
        self._rank_problem = engine.rank_problem  # safe from any thread (it asks the OS, not the engine)
        self._hooks = (on_outputs, between_steps, layer_hook)  # replaced whole by ``rebind``
        # (fn, its future, the prompt tokens it hands the engine or None)
        self._calls: queue.Queue[tuple[Callable[[LLMEngine], Any], Future, int | None] | tuple[None, None, None]] = (
            queue.Queue()
        )
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._lock = threading.Lock()  # the published copy and the prompts it does not show yet, together
        self._published: EngineStats = engine.stats()
        self._handed = (0, 0)  # prompts called and not in ``_published``: (requests, tokens)
        self._ran = (0, 0)  # of those, the ones run since the last copy; engine thread only
        self.error: BaseException | None = None  # set if a step failed: the server is broken
        self.last_round = time.monotonic()  # when the loop last went round (between two steps at most)
        self._stepping = False  # inside engine.step()

    def rebind(
        self,
        on_outputs: Callable[[LLMEngine, list[StepOutput]], None],
        *,
        between_steps: Callable[[LLMEngine], None] | None = None,
        layer_hook: LayerHook | None = None,
    ) -> None:
        """Another service takes the engine (a role switch in place, deploy/role_server.py): the next
        round calls these. One assignment, so a round sees either the old three or the new three; the
        caller makes sure the engine holds no request of the old service."""
        self._hooks = (on_outputs, between_steps, layer_hook)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        if self.started:  # a service that takes over a running engine thread (``rebind``)
            return
        previous = threading.stack_size(ENGINE_STACK_BYTES)  # read by the thread's start alone
        try:
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self.wake()
        self._thread.join(timeout)

    @property
    def stats(self) -> EngineStats:
        """The engine's last published copy, with the prompts handed since and not in it counted as
        waiting (safe from any thread)."""
        with self._lock:
            stats, (requests, tokens) = self._published, self._handed
        if not requests:
            return stats
        s = stats.scheduler
        scheduler = replace(s, queue_depth=s.queue_depth + requests, queued_tokens=s.queued_tokens + tokens)
        return replace(stats, scheduler=scheduler)

    def wake(self) -> None:
        """From any thread: an idle engine thread looks for work now (it waits for nothing else)."""
        self._calls.put(_WAKE)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def problem(self, stuck_after_s: float) -> str | None:
        """Why the engine cannot serve: its thread died, one of its tensor-parallel ranks exited
        (both deaths: the watchdog ends the process), or it has work and went no round (one step
        at most) for ``stuck_after_s``; None when it works."""
        if self._thread.ident is not None and not self.alive and not self._stopping.is_set():
            return f"engine thread died: {self.error!r}"
        rank = self._rank_problem()  # a tensor-parallel rank that exited: the engine cannot compute again
        if rank is not None and not self._stopping.is_set():
            return rank
        stalled = time.monotonic() - self.last_round
        if stalled > stuck_after_s and (self._stepping or self.stats.scheduler.num_requests or not self._calls.empty()):
            return f"engine thread made no progress for {stalled:.0f} s with work queued"
        return None

    def call(self, fn: Callable[[LLMEngine], T], *, prompt_tokens: int | None = None) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps. ``prompt_tokens``: ``fn`` adds a
        request with a prompt of that many tokens to compute, which ``stats`` counts as waiting meanwhile."""
        fut: Future[T] = Future()
        if not self.alive and self._thread.ident is not None:
            fut.set_exception(RuntimeError(f"engine thread is not running: {self.error!r}"))
            return fut
        if prompt_tokens is not None:
            self._count_handed(1, prompt_tokens)
        self._calls.put((fn, fut, prompt_tokens))
        if self._thread.ident is not None and not self._thread.is_alive():
            self._fail_pending()  # it died between the check and the put
        return fut

    async def run(self, fn: Callable[[LLMEngine], T], *, prompt_tokens: int | None = None) -> T:
        """``call`` for the event loop."""
        return await asyncio.wrap_future(self.call(fn, prompt_tokens=prompt_tokens))

    def _count_handed(self, requests: int, tokens: int) -> None:
        with self._lock:
            self._handed = (self._handed[0] + requests, self._handed[1] + tokens)

    def _run_calls(self, block: bool) -> None:
        try:
            fn, fut, tokens = self._calls.get() if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            if fn is not None and fut is not None and fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self._engine))
                except BaseException as exc:  # handed to the caller, who decides
                    fut.set_exception(exc)
            if tokens is not None:  # added or refused: the next copy says which
                self._ran = (self._ran[0] + 1, self._ran[1] + tokens)
            try:
                fn, fut, tokens = self._calls.get_nowait()
            except queue.Empty:
                return

    def _publish(self, stats: EngineStats) -> None:
        """``stats`` becomes the copy readers see; the prompts run before it was taken are in it."""
        ran, self._ran = self._ran, (0, 0)
        with self._lock:
            self._published = stats
            self._handed = (self._handed[0] - ran[0], self._handed[1] - ran[1])

    def _loop(self) -> None:
        engine = self._engine
        try:
            while not self._stopping.is_set():
                self._run_calls(block=not engine.has_unfinished())
                on_outputs, between_steps, layer_hook = self._hooks
                if between_steps is not None:
                    between_steps(engine)
                if engine.has_unfinished():
                    self._stepping = True
                    outputs = engine.step(layer_hook)
                    self._stepping = False
                    if outputs:
                        on_outputs(engine, outputs)
                self._publish(engine.stats())
                self.last_round = time.monotonic()
        except BaseException as exc:
            log.exception("engine thread died")
            self.error = exc
        finally:
            ran, self._ran = self._ran, (0, 0)
            self._count_handed(-ran[0], -ran[1])
            self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                _, fut, tokens = self._calls.get_nowait()
            except queue.Empty:
                return
            if tokens is not None:
                self._count_handed(-1, -tokens)
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("engine thread stopped"))
