"""GET /debug/tracemalloc's growth: the place that allocated what is still held comes first."""

from __future__ import annotations

import inspect

from server_common.heap_debug import HeapSnapshots


def test_growth_since_the_last_call_names_the_line_that_allocated_what_is_held():
    heap = HeapSnapshots()
    heap.start(frames=1)
    try:
        first = heap.growth(top=5)
        line = inspect.currentframe().f_lineno + 1
        held = [bytearray(1000) for _ in range(2000)]  # about 2 MB, still held at the next call
        second = heap.growth(top=5)
    finally:
        heap.stop()
    assert not first["compared_with_previous"] and second["compared_with_previous"]
    top = second["top"][0]
    assert top["where"] == [f"{__file__}:{line}"]
    assert top["count_diff"] >= 2000 and top["size_diff"] >= 2000 * 1000
    assert len(held) == 2000
    assert not heap.tracing()
