"""What the launcher prints while a user waits: plain lines, never a progress bar.

A launcher's output often goes to a log file, where a bar that redraws itself
with carriage returns becomes one endless line; so long steps (building a
model on first use) print one plain line every few seconds instead, and the
time reported at the end counts from the process's own start, the CLI's
imports included.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO


def seconds_since_process_start() -> float | None:
    """Seconds since this process started (Linux ``/proc``); None where that is unknown."""
    try:
        stat = open("/proc/self/stat").read()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime, in clock ticks after boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Heartbeat:
    """Prints ``pdserve: <what> ... <n> s`` every ``every`` seconds until the block ends.

    ::

        with Heartbeat("building model 'smollm2'", every=10):
            build()
    """

    def __init__(self, what: str, every: float = 10.0, out: TextIO | None = None) -> None:
        self._what, self._every, self._out = what, every, out or sys.stdout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._started = 0.0

    def __enter__(self) -> Heartbeat:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self._every):
            print(f"pdserve: {self._what} ... {time.monotonic() - self._started:.0f} s", file=self._out, flush=True)
