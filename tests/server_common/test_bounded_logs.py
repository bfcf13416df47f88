"""The servers' logs of recent requests keep a fixed number of entries, however many requests come."""

from __future__ import annotations

from server_common.quota import UnfilledBlocks
from server_common.timeline_log import TimelineLog


def test_the_timeline_keeps_its_capacity_of_newest_requests():
    log = TimelineLog(capacity=3)
    for i in range(5):
        log.add(f"r{i}", received=float(i))
    assert len(log) == 3
    assert [e["request_id"] for e in log.entries()] == ["r2", "r3", "r4"]


def test_unfilled_block_claims_are_gone_once_released():
    quota = UnfilledBlocks(limit=8)
    for i in range(3):
        quota.claim("10.0.0.1", f"t{i}", 2)
    assert (len(quota), quota.held("10.0.0.1")) == (3, 6)
    for i in range(3):
        quota.release(f"t{i}")
    quota.release("t-never-claimed")
    assert (len(quota), quota.held("10.0.0.1")) == (0, 0)
