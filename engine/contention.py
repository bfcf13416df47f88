"""Fewer CPU threads while the engine's process waits for cores: graceful beside a noisy neighbour.

A CPU step's kernels run on a team of torch's intra-op (OpenMP) threads, one per core, and each
parallel region ends when its slowest member does. Alone on its cores that is the fastest way; with
one more busy process on them (a sidecar, a log shipper, another tenant), one member of the team is
always descheduled, the others spin at the region's end waiting for it, and a decode step can take
tens of times longer than with one thread fewer.

``ThreadGovernor`` watches what the kernel says of that: the time this process's threads spent
runnable but not running (``/proc/self/task/*/schedstat``, the run-queue wait), per thread of the
team and per second of wall time. Above ``high`` (a quarter of the time) it takes a thread off the
team; after ``probe_s`` it tries one more again, and a probe that finds the contention still there
doubles the next wait (up to ``max_probe_s``), so a neighbour that stays costs one short probe now
and then, and one that leaves gives the cores back within a probe. It decides between steps, on the
engine thread, at most every ``check_s``: reading the counters costs tens of microseconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def runqueue_wait_s() -> float:
    """Seconds this process's threads have spent runnable but waiting for a core, since they started."""
    total = 0
    for task in os.scandir("/proc/self/task"):
        try:
            total += int(Path(task.path, "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            continue
    return total / 1e9


def schedstat_available() -> bool:
    try:
        Path("/proc/self/schedstat").read_text()
    except OSError:
        return False
    return True


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        *,
        waits: Callable[[], float] = runqueue_wait_s,
        clock: Callable[[], float] = time.monotonic,
        check_s: float = 0.5,
        high: float = 0.25,
        probe_s: float = 5.0,
        max_probe_s: float = 120.0,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._set, self._waits, self._clock = set_threads, waits, clock
        self.check_s, self.high = check_s, high
        self.probe_s, self.max_probe_s = probe_s, max_probe_s
        self._next_probe_s = probe_s
        self._probing = False
        self._at = clock()
        self._wait = waits()
        self._changed_at = self._at
        self.drops = 0  # threads taken off the team, in all
        self.probes = 0  # threads given back to try

    def after_step(self) -> None:
        """Between two steps: measure, and maybe change the team's size."""
        now = self._clock()
        if now - self._at < self.check_s:
            return
        wait = self._waits()
        share = (wait - self._wait) / (now - self._at) / self.threads
        self._at, self._wait = now, wait
        if share > self.high and self.threads > 1:
            if self._probing:  # the contention is still there: wait longer before the next try
                self._next_probe_s = min(self._next_probe_s * 2, self.max_probe_s)
            self._change(self.threads - 1, now)
            self.drops += 1
            self._probing = False
        elif self._probing:  # a probe that found the cores free: the next one soon again
            self._next_probe_s = self.probe_s
            self._probing = False
        elif self.threads < self.max_threads and now - self._changed_at >= self._next_probe_s:
            self._change(self.threads + 1, now)
            self.probes += 1
            self._probing = True

    def _change(self, threads: int, now: float) -> None:
        self.threads = threads
        self._set(threads)
        self._changed_at = now
        self._at, self._wait = now, self._waits()  # the next share is the new team's
