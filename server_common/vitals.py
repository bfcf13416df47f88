"""Whether a server's threads work: what /health reports beyond its load.

A server is as good as its engine thread and its transfer thread. Each
offers ``problem(stuck_after_s)``: None while it works, else why not (it
died, or it has work and made no progress for ``stuck_after_s``). /health
answers 503 with that reason, so the router and a Kubernetes probe take the
server out; a thread that died never comes back, so ``watch`` then ends the
process with ``EXIT_THREAD_DIED`` for its supervisor (``deploy/supervisor.py``
under ``pdserve launch``) to restart it. A stuck thread may recover, so it
only makes the server unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)
EXIT_THREAD_DIED = 70  # EX_SOFTWARE
WATCH_INTERVAL_S = 0.25

Check = Callable[[float], "str | None"]


class Vitals:
    def __init__(self, stuck_after_s: float) -> None:
        self.stuck_after_s = stuck_after_s
        self._checks: list[Check] = []

    def add(self, check: Check) -> None:
        self._checks.append(check)

    def problem(self) -> str | None:
        """The first thread that is dead or stuck, in words; None when all work."""
        return self._first(self.stuck_after_s)

    def death(self) -> str | None:
        """The first thread that died (stuck ones not counted)."""
        return self._first(math.inf)

    def _first(self, stuck_after_s: float) -> str | None:
        for check in self._checks:
            problem = check(stuck_after_s)
            if problem is not None:
                return problem
        return None

    async def watch(self, exit_process: Callable[[int], None] = os._exit) -> None:
        """Until cancelled: once a thread died, log it and end the process (no drain: its
        requests cannot finish without that thread; the router fails them with a clear error)."""
        while True:
            death = self.death()
            if death is not None:
                log.critical(
                    "%s; exiting with status %d so that the supervisor restarts this server", death, EXIT_THREAD_DIED
                )
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                exit_process(EXIT_THREAD_DIED)
                return
            await asyncio.sleep(WATCH_INTERVAL_S)
