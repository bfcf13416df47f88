"""Transfer ids, leases, checksums and the backend factory."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tests.transfer.oracle import copy_ranges
from transfer.backend import TransferError
from transfer.copy import region_bytes
from transfer.factory import make_backend
from transfer.integrity import IssuedTransfers, checksum_positions, kv_checksum
from transfer.layout import KVLayout
from transfer.plan import make_plan


def test_unknown_and_ended_ids_are_dropped_and_counted_apart():
    reg = IssuedTransfers("D")
    tid = reg.issue([1, 2], lease_s=5, now=100.0)
    assert reg.live(tid).block_ids == (1, 2)
    reg.end(tid, ok=True)
    assert reg.live(tid) is None and reg.live("D-never") is None  # looking counts nothing
    reg.count_drop(tid)
    reg.count_drop("D-never")
    assert reg.counters == {
        "issued": 1,
        "completed": 1,
        "failed": 0,
        "dropped_unknown": 1,
        "dropped_expired": 1,
        "checksum_failures": 0,
    }


def test_overdue_lists_only_reservations_past_their_lease():
    reg = IssuedTransfers("D")
    early, late = reg.issue([0], 1.0, now=10.0), reg.issue([1], 5.0, now=10.0)
    assert [e.transfer_id for e in reg.overdue(now=12.0)] == [early]
    assert early != late and early.startswith("D-")


def test_sampled_checksum_covers_first_last_and_is_deterministic():
    pos = checksum_positions("D-1", 16, 0, 200, "sampled")
    blocks = sorted(set((pos // 16).tolist()))
    assert len(blocks) == 4 and blocks[0] == 0 and blocks[-1] == 12
    assert (pos < 200).all()
    np.testing.assert_array_equal(pos, checksum_positions("D-1", 16, 0, 200, "sampled"))
    assert len(checksum_positions("D-1", 16, 0, 200, "all")) == 200
    assert len(checksum_positions("D-1", 16, 0, 200, "none")) == 0


def test_checksum_is_the_same_over_the_same_kv_in_different_layouts():
    src = KVLayout.for_engine_cache(
        num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=4, dtype="float32"
    )
    dst = src.replace(block_size=8, num_blocks=12, order="HND", kv_fused=True)
    a, b = torch.randn(src.shape), torch.zeros(dst.shape)
    plan = make_plan(src, [3, 1], 0, 30, dst, [9, 0, 4, 7])
    for layer in range(2):
        copy_ranges(region_bytes(a), region_bytes(b), *plan.layer(layer))
    pos = checksum_positions("t", 8, 0, 30, "all")
    assert kv_checksum(region_bytes(a), src, [3, 1], pos, (0, 1)) == kv_checksum(
        region_bytes(b), dst, [9, 0, 4, 7], pos, (0, 1)
    )
    b.view(-1)[dst.vector_offsets(0, 4, 3, 1) // 4] += 1.0  # one element of K, token 19
    assert kv_checksum(region_bytes(a), src, [3, 1], pos, (0, 1)) != kv_checksum(
        region_bytes(b), dst, [9, 0, 4, 7], pos, (0, 1)
    )


def test_missing_nixl_names_the_zmq_option(monkeypatch):
    monkeypatch.delitem(sys.modules, "transfer.nixl_backend", raising=False)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(TransferError, match="set the transfer backend to 'zmq'"):
        make_backend("nixl", "P")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="'rdma' is not one of"):
        make_backend("rdma", "P")
