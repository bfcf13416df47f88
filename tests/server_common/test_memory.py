"""Freed heap goes back to the system: the router's after a large request, a server's while its engine works
(server_common/memory.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from server_common.memory import trim_while_busy
from tests.waiting import until

CHILD = textwrap.dedent("""
    import sys
    from server_common.memory import Trimmer
    from tests.waiting import wait_until

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    bytearray(8 << 20)  # freed at once: glibc raises its mmap threshold to 8 MiB
    base = rss_mb()
    blocks, pins = [], []
    for _ in range(100):  # 400 MB of 4 MiB blocks, now from the heap, each followed by a small pinned one
        blocks.append(bytearray(4 << 20))
        pins.append(bytearray(1024))
    del blocks
    held = rss_mb()
    trimmer = Trimmer(threshold=1 << 20)
    trimmer.after(100)  # below the threshold: nothing
    trimmer.after(400 << 20)
    wait_until(lambda: trimmer.trims == 1, 10.0, "the trim ran")
    print(round(held - base), round(rss_mb() - base), trimmer.trims)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_a_large_request_s_freed_heap_goes_back_to_the_system():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    held, after, trims = map(int, out.stdout.split())
    assert held > 350  # freed, but the heap kept the pages
    assert after < 50 and trims == 1


class CountingTrimmer:
    def __init__(self) -> None:
        self.trims = 0

    def trim_now(self) -> None:
        self.trims += 1


def test_a_server_trims_once_per_interval_while_its_engine_steps_and_once_after_it_stopped():
    trimmer, steps, reads = CountingTrimmer(), [0], [0]

    def activity() -> int:
        reads[0] += 1
        return steps[0]

    async def main() -> None:
        task = asyncio.ensure_future(trim_while_busy(trimmer, activity, interval_s=0.001))
        try:
            await until(lambda: reads[0] >= 5)
            assert trimmer.trims == 0  # idle since it started: nothing to give back
            steps[0] = 7  # the engine stepped
            await until(lambda: trimmer.trims == 1)
            seen = reads[0]
            await until(lambda: reads[0] >= seen + 5)
            assert trimmer.trims == 1  # no step since: no second trim
        finally:
            task.cancel()

    asyncio.run(main())
