"""After a large request the router gives its freed heap back (server_common/memory.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
