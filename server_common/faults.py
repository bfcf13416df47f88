"""Deterministic fault injection for tests (config ``fault_injection: true`` only).

When the cluster config enables it, each prefill and decode server holds one
``FaultInjector`` and mounts ``/admin/faults`` (``server_common.fault_routes``);
otherwise neither exists and no code path below runs. A test arms a
``FaultPlan``, waits until the server reports it reached the pause point
(``held`` / ``stalled``), does its harm (kill a process, drop a client), then
releases. Faults and where they act::

    hold_prefill        P  /prefill waits before its request reaches the engine
    hold_reads          D  a prefix read (/kv/read) waits with its tokens copied out, before it answers:
                            a read in flight, for a test that kills the decode server during it
    hold_opens n        D  the next n /generate opens wait before their reservation (or local admission),
                            their stream not started: an open slower than the router's stream_stall_s
    stall_after_layer   P  the engine thread stops after pushing layer k (once)
    drop_notices n      P  the next n completion notices are lost on the wire
    delay_notices n     P  the next n notices leave notice_delay_s late
    corrupt_writes n    D  one byte of each of the next n KV writes received is flipped
    corrupt_reads n     D  one byte of each of the next n prefix reads sent (decode-to-prefill reuse) is
                            flipped after its checksum was computed
    step_delay_s        D  the engine thread sleeps after each step that produced tokens
    pause_after_tokens k D  the engine thread stops (once) right after it streamed its k-th token
                            since the plan was armed: the tokens so far are on their way, no more come
    break_transport n   P/D the transfer backend's next n polls raise: the transfer thread dies,
                            so /health turns 503 and the server exits to be restarted

Holds and stalls end on ``release`` (which also ends ``step_delay_s``) or
after ``pause_timeout_s``, so a test that forgets one cannot wedge a server. Thread-safe: the event loop, the
engine thread and the transfer thread all call in.
"""

from __future__ import annotations

import asyncio
import threading
import time

from pydantic import BaseModel, ConfigDict, Field

COUNTERS = ("drop_notices", "delay_notices", "corrupt_writes", "corrupt_reads", "break_transport")


class FaultPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    hold_prefill: bool = False
    hold_reads: bool = False
    hold_opens: int = Field(default=0, ge=0)
    stall_after_layer: int | None = Field(default=None, ge=0)
    drop_notices: int = Field(default=0, ge=0)
    delay_notices: int = Field(default=0, ge=0)
    notice_delay_s: float = Field(default=0.0, ge=0, le=60)
    corrupt_writes: int = Field(default=0, ge=0)
    corrupt_reads: int = Field(default=0, ge=0)
    break_transport: int = Field(default=0, ge=0)
    step_delay_s: float = Field(default=0.0, ge=0, le=5)
    pause_after_tokens: int | None = Field(default=None, ge=1)
    pause_timeout_s: float = Field(default=5.0, gt=0, le=60)


class FaultStatus(BaseModel):
    plan: FaultPlan  # what is still armed (counters count down)
    held: int  # /prefill calls waiting in hold_prefill now
    held_reads: int  # /kv/read calls waiting in hold_reads now
    held_opens: int  # /generate opens waiting in hold_opens now
    stalled: bool  # the engine thread is stopped in stall_after_layer now
    injected: dict[str, int]  # faults injected since start, by kind


class FaultInjector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plan = FaultPlan()
        self._release = threading.Event()
        self._held = {"hold_prefill": 0, "hold_reads": 0, "hold_opens": 0}  # calls waiting in each hold now
        self._stalled = False
        self._tokens = 0  # streamed since the plan was armed (pause_after_tokens)
        self._injected = {
            "held": 0,
            "reads_held": 0,
            "opens_held": 0,
            "stalled": 0,
            "notices_dropped": 0,
            "notices_delayed": 0,
            "writes_corrupted": 0,
            "reads_corrupted": 0,
            "transport_broken": 0,
        }

    # ---- control (HTTP routes) ---------------------------------------------------
    def arm(self, plan: FaultPlan) -> None:
        """Replace the plan; pauses of the previous plan are released."""
        with self._lock:
            self._release.set()
            self._plan, self._release = plan, threading.Event()
            self._tokens = 0

    def release(self) -> None:
        """End holds, stalls and slow steps now; counted faults stay armed."""
        with self._lock:
            self._plan = self._plan.model_copy(
                update={
                    "hold_prefill": False,
                    "hold_reads": False,
                    "hold_opens": 0,
                    "stall_after_layer": None,
                    "step_delay_s": 0.0,
                    "pause_after_tokens": None,
                }
            )
            self._release.set()

    def status(self) -> FaultStatus:
        with self._lock:
            return FaultStatus(
                plan=self._plan,
                held=self._held["hold_prefill"],
                held_reads=self._held["hold_reads"],
                held_opens=self._held["hold_opens"],
                stalled=self._stalled,
                injected=dict(self._injected),
            )

    # ---- hooks ---------------------------------------------------------------------
    def take(self, counter: str) -> bool:
        """Consume one armed ``drop_notices`` / ``delay_notices`` / ``corrupt_writes`` / ``corrupt_reads`` /
        ``break_transport``."""
        assert counter in COUNTERS, counter
        with self._lock:
            left = getattr(self._plan, counter)
            if left <= 0:
                return False
            self._plan = self._plan.model_copy(update={counter: left - 1})
            done = {
                "drop_notices": "notices_dropped",
                "delay_notices": "notices_delayed",
                "corrupt_writes": "writes_corrupted",
                "corrupt_reads": "reads_corrupted",
                "break_transport": "transport_broken",
            }[counter]
            self._injected[done] += 1
            return True

    @property
    def notice_delay_s(self) -> float:
        return self._plan.notice_delay_s

    def step_delay(self) -> None:
        """Engine thread, after a step."""
        delay = self._plan.step_delay_s
        if delay:
            time.sleep(delay)

    async def hold(self) -> None:
        """Event loop: wait here while hold_prefill is armed (polls: no thread per held call)."""
        await self._hold("hold_prefill", "held")

    async def hold_read(self) -> None:
        """Event loop, a decode server's prefix read with its tokens copied out: wait here while
        hold_reads is armed."""
        await self._hold("hold_reads", "reads_held")

    async def hold_open(self) -> None:
        """Event loop, a decode server's ``/generate`` open before its reservation: the next
        ``hold_opens`` opens wait here (one of the count each)."""
        await self._hold("hold_opens", "opens_held")

    async def _hold(self, switch: str, injected: str) -> None:
        with self._lock:
            armed = getattr(self._plan, switch)
            if not armed:
                return
            if armed is not True:  # a count: this call takes one
                self._plan = self._plan.model_copy(update={switch: armed - 1})
            release, timeout = self._release, self._plan.pause_timeout_s
            self._held[switch] += 1
            self._injected[injected] += 1
        deadline = time.monotonic() + timeout
        try:
            while not release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            with self._lock:
                self._held[switch] -= 1

    def streamed(self, num_tokens: int) -> None:
        """Engine thread, after a step's tokens were handed to their streams: stop once, until
        released, when they make ``pause_after_tokens``."""
        with self._lock:
            limit = self._plan.pause_after_tokens
            if limit is None or not num_tokens:
                return
            self._tokens += num_tokens
            if self._tokens < limit:
                return
            self._plan = self._plan.model_copy(update={"pause_after_tokens": None})  # once per arming
        self._pause()

    def stall(self, layer: int) -> None:
        """Engine thread, after ``layer`` was pushed: stop once, until released."""
        with self._lock:
            if self._plan.stall_after_layer != layer:
                return
            self._plan = self._plan.model_copy(update={"stall_after_layer": None})  # once per arming
        self._pause()

    def _pause(self) -> None:
        with self._lock:
            release, timeout = self._release, self._plan.pause_timeout_s
            self._stalled = True
            self._injected["stalled"] += 1
        try:
            release.wait(timeout)
        finally:
            with self._lock:
                self._stalled = False
