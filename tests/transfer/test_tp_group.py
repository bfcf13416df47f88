"""A transfer between TP groups in one process: every P rank pushes its part
straight into the D ranks holding its heads; the group completes when every
part did, and one rank's failure ends every part and the whole group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.tensor_parallel import kv_heads_for_rank
from tests.transfer.helpers import make_receiver, make_sender, meet, wait_events
from tests.transfer.oracle import expected_after_copy
from tests.waiting import wait_until
from transfer.copy import region_bytes
from transfer.group import RankParts, ReceiverGroup, SenderGroup
from transfer.layout import KVLayout
from transfer.messages import group_to_builtins, parse_group, single_rank
from transfer.outcome import Outcome, TransferEnded
from transfer.tp import route_heads

SRC_BLOCKS, DST_BLOCKS, TOKENS = [5, 1, 7, 2], [6, 0, 3, 9, 4, 8, 11, 10], 57


def ranks(total: int, tp: int, bs: int, blocks: int, **kw) -> list[KVLayout]:
    return [
        KVLayout(
            num_layers=3,
            num_kv_heads_total=total,
            head_ids=kv_heads_for_rank(total, r, tp),
            head_dim=8,
            block_size=bs,
            num_blocks=blocks,
            tp_rank=r,
            tp_size=tp,
            **kw,
        )
        for r in range(tp)
    ]


def true_cache(layout: KVLayout, seed: int) -> torch.Tensor:
    """A P rank's cache: random, except that a head held by several ranks (replicated) has the same values on each."""
    full = torch.randn(
        (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads_total, 8),
        generator=torch.Generator().manual_seed(seed),
    )
    mine = full[:, :, :, :, list(layout.head_ids)]
    if layout.order == "HND":
        mine = mine.transpose(3, 4)
    return mine.contiguous()


@pytest.fixture
def tp(hub, closing):
    """``tp(src_layouts, dst_layouts) -> (SenderGroup, ReceiverGroup)``: every rank pair met."""

    def build(src: list[KVLayout], dst: list[KVLayout]):
        senders = [
            closing(make_sender("inproc", hub, f"P-r{s.tp_rank}", s, cache=true_cache(s, 7), checksum="all"))
            for s in src
        ]
        receivers = [closing(make_receiver("inproc", hub, f"D-r{d.tp_rank}", d, cancel_grace_s=0.2)) for d in dst]
        for sender in senders:
            for receiver in receivers:
                meet(sender, receiver)
        return SenderGroup(senders), ReceiverGroup(receivers)

    return build


def wanted(senders: SenderGroup, receivers: ReceiverGroup, start: int, end: int) -> list[np.ndarray]:
    """Each D rank's cache after the copy: every route's heads from its P rank (the oracle's own indexing)."""
    out = [np.zeros(d.total_bytes, dtype=np.uint8) for d in receivers.layouts]
    for route in route_heads(senders.layouts, receivers.layouts):
        src = senders.layouts[route.src_rank]
        only = src.replace(head_ids=route.heads, tp_rank=0, tp_size=1, num_kv_heads_total=src.num_kv_heads_total)
        cache = senders.ranks[route.src_rank]._cache
        picked = (
            cache[:, :, :, :, list(src.local_head_index(route.heads))]
            if src.order == "NHD"
            else cache[:, :, :, list(src.local_head_index(route.heads))]
        )
        out[route.dst_rank] = expected_after_copy(
            region_bytes(picked.contiguous()).numpy(),
            only,
            SRC_BLOCKS,
            start,
            end,
            out[route.dst_rank],
            receivers.layouts[route.dst_rank],
            DST_BLOCKS,
        )
    return out


def no_leak(senders: SenderGroup, receivers: ReceiverGroup, transfers: int = 1) -> None:
    """Every part of every group ended on every rank: no reservation or transfer is left open."""
    assert senders.open_transfers() == 0 and receivers.open_transfers() == 0
    assert all(not s._out for s in senders.ranks)
    for counters in receivers.counters():
        assert counters["issued"] == counters["completed"] + counters["failed"] == transfers


PAIRS = {
    "p2-d1": (ranks(4, 2, 16, 8), ranks(4, 1, 8, 12)),
    "p1-d2": (ranks(4, 1, 16, 8), ranks(4, 2, 16, 12, order="HND")),
    "p2-d2-block-sizes": (ranks(4, 2, 16, 8), ranks(4, 2, 8, 12, order="HND")),
    "p2-d4-replicated-on-d": (ranks(2, 2, 16, 8), ranks(2, 4, 8, 12)),
    "p4-d2-replicated-on-p": (ranks(2, 4, 16, 8), ranks(2, 2, 8, 12, kv_fused=True)),
}


@pytest.mark.parametrize("pair", PAIRS)
def test_every_tp_pair_moves_each_ranks_heads_exactly_in_two_chunks(tp, pair):
    senders, receivers = tp(*PAIRS[pair])
    gid, target = receivers.expect(DST_BLOCKS, lease_s=10, writable_from=1)
    target = parse_group(group_to_builtins(target))  # as the reservation carries it
    senders.begin(gid, target, DST_BLOCKS, lease_s=10)
    for start, end in ((16, 40), (40, TOKENS)):  # tokens 0-15: D's cached prefix (block 6 is not writable)
        for layer in range(3):
            senders.push_layer(gid, layer, SRC_BLOCKS, start, end)
    senders.finish(gid, (42, 43))
    ended_d, ended_p = wait_events(receivers), wait_events(senders)
    assert [(e.transfer_id, e.outcome, e.first_tokens) for e in ended_d.ended] == [(gid, Outcome.OK, (42, 43))]
    assert [(e.transfer_id, e.outcome) for e in ended_p.ended] == [(gid, Outcome.OK)]
    for d, want in enumerate(wanted(senders, receivers, 16, TOKENS)):
        np.testing.assert_array_equal(region_bytes(receivers.ranks[d]._cache).numpy(), want)
    no_leak(senders, receivers)
    assert all(c["completed"] == 1 for c in receivers.counters())


def test_a_tp1_reservation_is_a_group_of_one(tp):
    senders, receivers = tp(ranks(4, 2, 16, 8), ranks(4, 1, 8, 12))
    tid = receivers.ranks[0].expect(DST_BLOCKS, lease_s=10)  # today's tp_size 1 decode server
    target = single_rank(tid, "D-r0", senders.ranks[0].peer_layout("D-r0"))
    senders.begin(tid, target, DST_BLOCKS, lease_s=10)
    for layer in range(3):
        senders.push_layer(tid, layer, SRC_BLOCKS, 0, TOKENS)
    senders.finish(tid, (5,))
    assert [e.first_tokens for e in wait_events(receivers.ranks[0]).completed] == [(5,)]
    assert [e.outcome for e in wait_events(senders).ended] == [Outcome.OK]
    np.testing.assert_array_equal(
        region_bytes(receivers.ranks[0]._cache).numpy(), wanted(senders, receivers, 0, TOKENS)[0]
    )


def test_one_decode_rank_failing_ends_every_part_with_its_code(tp):
    senders, receivers = tp(*PAIRS["p2-d4-replicated-on-d"])
    gid, target = receivers.expect(DST_BLOCKS, lease_s=10)
    senders.begin(gid, target, DST_BLOCKS, lease_s=10)
    receivers.ranks[2].cancel(target.ranks[2].transfer_id, "rank 2 gave up")  # one rank's own failure
    # Ended before any write: a cancel still queued while the Done arrives loses to it (the part completes).
    wait_until(lambda: receivers.ranks[2].open_transfers() == 0, what="D rank 2's part cancelled")
    for layer in range(3):
        senders.push_layer(gid, layer, SRC_BLOCKS, 0, TOKENS)
    senders.finish(gid, (1,))
    ended_d, ended_p = wait_events(receivers), wait_events(senders)
    assert [(e.transfer_id, e.outcome, e.reason) for e in ended_d.ended] == [
        (gid, Outcome.CANCELLED, "rank 2: rank 2 gave up")
    ]
    # P rank 1 hears of it as the Cancel, or as the refusal of a Done it sent before the Cancel came
    assert [(e.transfer_id, e.outcome in (Outcome.CANCELLED, Outcome.REFUSED)) for e in ended_p.ended] == [(gid, True)]
    no_leak(senders, receivers)
    assert receivers.counters()[2]["failed"] == 1


def test_one_prefill_rank_failing_fails_its_group_and_the_decode_group_at_the_lease(tp):
    senders, receivers = tp(*PAIRS["p2-d4-replicated-on-d"])
    gid, target = receivers.expect(DST_BLOCKS, lease_s=0.6)
    senders.begin(gid, target, DST_BLOCKS, lease_s=0.6)
    for part in (target.ranks[2].transfer_id, target.ranks[3].transfer_id):
        senders.ranks[1].abort(part)  # P rank 1 fails: D ranks 2 and 3 never get head 1
    for layer in range(3):
        senders.push_layer(gid, layer, SRC_BLOCKS, 0, TOKENS)
    senders.finish(gid, (1,))
    assert [(e.transfer_id, e.outcome, e.reason) for e in wait_events(senders).ended] == [
        (gid, Outcome.ABORTED, "rank 1: aborted")
    ]
    [ended] = wait_events(receivers, timeout_s=5).ended
    assert (ended.transfer_id, ended.outcome) == (gid, Outcome.LEASE_EXPIRED)
    assert ended.reason.startswith("rank ") and ended.reason.endswith(": lease expired before the KV arrived")
    no_leak(senders, receivers)
    assert [c["failed"] for c in receivers.counters()][2:] == [1, 1]


def test_a_receiver_refuses_a_head_from_two_senders(hub, closing):
    [dst] = ranks(4, 1, 16, 4)
    receiver = closing(make_receiver("inproc", hub, "D", dst))
    a = closing(make_sender("inproc", hub, "A", dst, checksum="all"))
    b = closing(make_sender("inproc", hub, "B", dst, checksum="all"))
    tid = receiver.expect([1], lease_s=10)
    for sender, heads in ((a, (0, 1, 2)), (b, (2, 3))):
        sender.begin(tid, meet(sender, receiver), [1], 10, heads=heads)
        for layer in range(3):
            sender.push_layer(tid, layer, [0], 0, 16)
        sender.finish(tid, (3,))
        wait_events(sender)  # one after the other: A's notice is verified first
    [ended] = wait_events(receiver).ended
    assert (ended.outcome, ended.reason) == (Outcome.BAD_NOTICE, "heads [2] already arrived from another sender")


def ended(tid, outcome=Outcome.OK, first=(1,), reason=""):
    return TransferEnded(tid, outcome, reason, first if outcome is Outcome.OK else None, 0.0)


def test_rank_parts_end_a_group_only_when_its_last_part_ended():
    parts = RankParts()
    parts.open("g", [(0, "a"), (1, "a"), (1, "b")])
    assert parts.feed(1, ended("a")) == ([], None)
    assert parts.feed(0, ended("zzz")) == ([], None)  # no group's part: ignored
    stop, end = parts.feed(0, ended("a", Outcome.TRANSPORT, reason="write failed"))
    assert (stop, end) == ([(1, "b")], None)
    stop, end = parts.feed(1, ended("b", Outcome.ABORTED, reason="aborted"))
    assert stop == [] and (end.transfer_id, end.outcome, end.reason) == ("g", Outcome.TRANSPORT, "rank 0: write failed")
    assert len(parts) == 0


def test_rank_parts_refuse_ranks_that_disagree_on_the_first_tokens():
    parts = RankParts()
    parts.open("g", [(0, "a"), (1, "b")])
    parts.feed(0, ended("a", first=(1,)))
    _, end = parts.feed(1, ended("b", first=(2,)))
    assert (end.outcome, end.reason) == (Outcome.BAD_NOTICE, "ranks disagree on the first tokens: [(1,), (2,)]")


def test_rank_parts_refuse_a_part_of_two_groups():
    parts = RankParts()
    parts.open("g", [(0, "a")])
    with pytest.raises(ValueError, match="belong to another"):
        parts.open("h", [(0, "a")])
    with pytest.raises(ValueError, match="already open"):
        parts.open("g", [(0, "b")])
