"""One KV tier on its own (engine/tiers/tier.py and its host and disk stores): byte limits with LRU
eviction, checksums checked on every read, writes that never wait (a full queue drops them, counted),
and a disk folder that a new process indexes again."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.tiers.disk import HEADER, DiskTier
from engine.tiers.host import HostTier
from engine.tiers.tier import Tier, block_checksum

SIZE = 100  # bytes of one test block


def block(k: int) -> torch.Tensor:
    return torch.arange(SIZE, dtype=torch.uint8) + k


def tier_of(kind: str, tmp_path, max_bytes: int, queue_blocks: int = 64) -> Tier:
    if kind == "host":
        return HostTier(max_bytes, queue_blocks)
    return DiskTier(tmp_path / "kv", max_bytes, queue_blocks)


def per_entry(kind: str) -> int:
    return SIZE + (HEADER.size if kind == "disk" else 0)


@pytest.fixture(params=["host", "disk"])
def kind(request) -> str:
    return request.param


def test_a_tier_keeps_its_newest_blocks_within_its_bytes(kind, tmp_path):
    tier = tier_of(kind, tmp_path, max_bytes=3 * per_entry(kind))
    try:
        for k in range(5):
            assert tier.put(k, block(k))
        assert tier.drain()
        stats = tier.stats()
        assert (stats.entries, stats.bytes_held, stats.evictions) == (3, 3 * per_entry(kind), 2)
        assert stats.bytes_written == 5 * per_entry(kind)
        assert [tier.contains(k) for k in range(5)] == [False, False, True, True, True]
        assert tier.get(0) is None  # evicted: a miss
        assert torch.equal(tier.get(2), block(2))  # now the most recently used
        assert tier.put(5, block(5)) and tier.drain()
        assert [tier.contains(k) for k in range(6)] == [False, False, True, False, True, True]
        stats = tier.stats()
        assert (stats.hits, stats.misses, stats.corrupt, stats.bytes_read) == (1, 1, 0, SIZE)
        if kind == "disk":
            assert sorted(p.name for p in tier.folder.iterdir()) == sorted(tier.path(k).name for k in (2, 4, 5))
    finally:
        tier.close()


def test_a_block_larger_than_the_tier_is_dropped_and_counted(kind, tmp_path):
    tier = tier_of(kind, tmp_path, max_bytes=SIZE // 2)
    try:
        tier.put(1, block(1))
        assert tier.drain()
        stats = tier.stats()
        assert (stats.entries, stats.bytes_held, stats.dropped_writes) == (0, 0, 1)
    finally:
        tier.close()


def test_a_full_queue_drops_the_write_instead_of_waiting(tmp_path):
    """The writer is held inside its first store; the queue (one place) takes one more; the third put
    returns at once, dropped and counted."""

    class HeldHost(HostTier):
        def __init__(self) -> None:
            self.entered, self.release = threading.Event(), threading.Event()
            super().__init__(max_bytes=10 * SIZE, queue_blocks=1)

        def _persist(self, h: int, data: torch.Tensor, checksum: int) -> int:
            self.entered.set()
            assert self.release.wait(30)
            return super()._persist(h, data, checksum)

    tier = HeldHost()
    try:
        assert tier.put(1, block(1))
        assert tier.entered.wait(30)
        assert tier.put(2, block(2))
        assert not tier.put(3, block(3))
        assert tier.stats().dropped_writes == 1
        tier.release.set()
        assert tier.drain()
        assert [tier.contains(k) for k in (1, 2, 3)] == [True, True, False]
    finally:
        tier.release.set()
        tier.close()


def test_a_host_entry_whose_bytes_changed_is_corrupt_and_never_served(tmp_path):
    tier = HostTier(10 * SIZE)
    try:
        data = block(7)
        tier.put(7, data, block_checksum(data))
        assert tier.drain()
        data[3] ^= 1  # the stored tensor changed after it was written
        assert tier.get(7) is None and not tier.contains(7)
        stats = tier.stats()
        assert (stats.hits, stats.misses, stats.corrupt, stats.entries, stats.bytes_held) == (0, 1, 1, 0, 0)
    finally:
        tier.close()


def test_a_disk_entry_with_a_wrong_checksum_in_its_header_is_corrupt(tmp_path):
    tier = DiskTier(tmp_path / "kv", 10 * SIZE)
    try:
        tier.put(9, block(9), checksum=block_checksum(block(9)) ^ 1)
        assert tier.drain()
        assert tier.get(9) is None and not tier.path(9).exists()
        assert tier.stats().corrupt == 1
    finally:
        tier.close()


def test_a_new_disk_tier_indexes_what_the_folder_holds_and_trims_it(tmp_path):
    first = DiskTier(tmp_path / "kv", 10 * per_entry("disk"))
    for k in range(4):
        first.put(k, block(k))
    assert first.drain()
    first.close()
    (tmp_path / "kv" / ".0000000000000001.99.tmp").write_bytes(b"half a block")  # a writer killed mid-file
    second = DiskTier(tmp_path / "kv", 2 * per_entry("disk"))
    try:
        assert second.stats().entries == 2 and second.stats().bytes_held == 2 * per_entry("disk")
        assert not list((tmp_path / "kv").glob("*.tmp"))
        assert len(list((tmp_path / "kv").glob("*.kv"))) == 2
        served = [k for k in range(4) if second.get(k) is not None]
        assert len(served) == 2
        assert all(torch.equal(second.get(k), block(k)) for k in served)
    finally:
        second.close()


def test_a_write_that_fails_is_dropped_counted_and_the_tier_goes_on(tmp_path):
    tier = DiskTier(tmp_path / "kv", 10 * SIZE)
    try:
        tier.put(1, torch.arange(2 * SIZE, dtype=torch.uint8)[::2])  # not contiguous: its checksum raises
        tier.put(2, block(2))
        assert tier.drain()
        assert tier.stats().dropped_writes == 1
        assert not tier.contains(1) and torch.equal(tier.get(2), block(2))
        assert not list((tmp_path / "kv").glob("*.tmp"))
    finally:
        tier.close()
