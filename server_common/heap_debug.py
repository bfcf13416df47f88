"""Where a process's Python memory grew, for ``GET /debug/tracemalloc``.

Off until ``POST /debug/tracemalloc/start?frames=N`` (N frames kept per
allocation; tracing costs CPU and memory, so only while hunting a leak) and
again after ``POST /debug/tracemalloc/stop``; only allocations made while it is
on are seen, which is what a hunt for growth under load wants (and a process
started with Python's own ``PYTHONTRACEMALLOC=N`` traces from its first import,
at a high cost in start time). Each ``GET /debug/tracemalloc`` takes a snapshot
and compares it with the one the call before took: the places whose live
allocations grew most in between, by bytes. The first call compares with
nothing (every live traced allocation counts as growth). Only the last snapshot
is held. ``bench/load/soak.py --tracemalloc N`` does this while a soak runs;
by hand::

    S="authorization: Bearer $(cat RUN_DIR/internal_secret)"
    curl -X POST -H "$S" 'localhost:8100/debug/tracemalloc/start?frames=8'
    curl -H "$S" 'localhost:8100/debug/tracemalloc?top=20'   # and again, minutes later
"""

from __future__ import annotations

import threading
import tracemalloc

# Their own allocations are not the server's: the snapshot machinery and the import system.
_IGNORED = (
    "<frozen importlib._bootstrap>",
    "<frozen importlib._bootstrap_external>",
    tracemalloc.__file__,
    "<unknown>",
)


class HeapSnapshots:
    def __init__(self) -> None:
        self._last: tracemalloc.Snapshot | None = None
        self._lock = threading.Lock()  # one snapshot at a time (routes may run on worker threads)

    @staticmethod
    def tracing() -> bool:
        return tracemalloc.is_tracing()

    def start(self, frames: int) -> None:
        """Trace from now on, ``frames`` frames per allocation (a restart with another count drops the traces)."""
        with self._lock:
            if tracemalloc.is_tracing() and tracemalloc.get_traceback_limit() != frames:
                tracemalloc.stop()
                self._last = None
            tracemalloc.start(frames)

    def stop(self) -> None:
        """Stop tracing and free the traces and the snapshot."""
        with self._lock:
            tracemalloc.stop()
            self._last = None

    def growth(self, top: int = 25, group_by: str = "lineno") -> dict:
        """The ``top`` places (``lineno`` or ``traceback``) whose live bytes grew most since the last call,
        and the totals. Call only while ``tracing()``."""
        assert group_by in ("lineno", "traceback", "filename"), group_by
        with self._lock:
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, f) for f in _IGNORED])
            before, self._last = self._last, snap
        stats = snap.compare_to(before, group_by) if before is not None else None
        lines = (
            [_diff_line(s) for s in stats[:top]]
            if stats is not None
            else [_line(s) for s in snap.statistics(group_by)[:top]]
        )
        current, peak = tracemalloc.get_traced_memory()
        return {
            "traced_bytes": current,
            "traced_peak_bytes": peak,
            "frames": tracemalloc.get_traceback_limit(),
            "compared_with_previous": before is not None,
            "top": lines,
        }


def _where(trace: tracemalloc.Traceback) -> list[str]:
    return [f"{frame.filename}:{frame.lineno}" for frame in trace]


def _diff_line(stat: tracemalloc.StatisticDiff) -> dict:
    return {
        "where": _where(stat.traceback),
        "size_diff": stat.size_diff,
        "size": stat.size,
        "count_diff": stat.count_diff,
        "count": stat.count,
    }


def _line(stat: tracemalloc.Statistic) -> dict:
    return {"where": _where(stat.traceback), "size_diff": stat.size, "size": stat.size, "count_diff": stat.count}
