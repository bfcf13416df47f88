"""KVSender -> KVReceiver in one process: conversions, TP, and everything a
receiver must refuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.tensor_parallel import kv_heads_for_rank
from tests.transfer.conftest import nixl_available
from tests.transfer.helpers import make_receiver, make_sender, meet, push_all, wait_events
from tests.transfer.oracle import expected_after_copy
from tests.waiting import wait_until
from transfer.copy import region_bytes
from transfer.inproc import InprocBackend, InprocHub
from transfer.integrity import checksum_positions, kv_checksum
from transfer.layout import IncompatiblePeer, KVLayout
from transfer.messages import Done, encode
from transfer.outcome import PeerBound
from transfer.sender import Abort, Begin, Push
from transfer.tp import route_heads

KINDS = [
    "inproc",
    "zmq",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed")),
]


def layout(bs=16, blocks=16, dtype="float32", **kw) -> KVLayout:
    heads = kw.pop("heads", 4)
    if kw.get("tp_size", 1) > 1:
        kw["head_ids"] = kv_heads_for_rank(heads * kw["tp_size"], kw["tp_rank"], kw["tp_size"])
    return KVLayout.for_engine_cache(
        num_layers=3, num_blocks=blocks, block_size=bs, num_kv_heads=heads, head_dim=8, dtype=dtype, **kw
    )


def expected(sender, src_layout, src_blocks, end, receiver_layout, dst_blocks, base=None):
    """The receiver cache we must see: the sender's cache converted, copied
    over ``base`` (zeros by default)."""
    staging = sender._cache.to(getattr(torch, receiver_layout.dtype))
    if base is None:
        base = np.zeros(receiver_layout.total_bytes, dtype=np.uint8)
    return expected_after_copy(
        region_bytes(staging).numpy(),
        src_layout.replace(dtype=receiver_layout.dtype),
        src_blocks,
        0,
        end,
        base,
        receiver_layout,
        dst_blocks,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_arrives_converted_exactly(kind, hub, closing):
    src, dst = layout(16, dtype="bfloat16"), layout(32, blocks=8).replace(order="HND")
    sender = closing(make_sender(kind, hub, "P", src, checksum="all"))
    receiver = closing(make_receiver(kind, hub, "D", dst))
    peer = meet(sender, receiver)
    tid = receiver.expect([6, 2], lease_s=10)
    sender.begin(tid, peer, [6, 2], lease_s=10)
    push_all(sender, tid, src, [3, 0, 9], 0, 20, finish=False)  # chunk 1
    push_all(sender, tid, src, [3, 0, 9], 20, 41, first_tokens=(99,))  # chunk 2
    got = wait_events(receiver)
    assert [(c.transfer_id, c.first_tokens) for c in got.completed] == [(tid, (99,))], got
    assert [c.transfer_id for c in wait_events(sender).completed] == [tid]
    np.testing.assert_array_equal(
        region_bytes(receiver._cache).numpy(), expected(sender, src, [3, 0, 9], 41, dst, [6, 2])
    )


def test_two_tp_prefill_ranks_fill_one_decode_rank(hub, closing):
    ranks = [layout(16, heads=2, tp_rank=r, tp_size=2) for r in (0, 1)]
    dst = layout(64, blocks=4)
    receiver = closing(make_receiver("inproc", hub, "D", dst))
    senders = [closing(make_sender("inproc", hub, f"P{r}", ranks[r])) for r in (0, 1)]
    peers = [meet(s, receiver) for s in senders]
    tid = receiver.expect([1], lease_s=10)
    senders[0].begin(tid, peers[0], [1], 10)
    push_all(senders[0], tid, ranks[0], [4, 5], 0, 30, first_tokens=(5,))
    assert wait_events(receiver, timeout_s=0.3).completed == []  # one rank is not enough
    senders[1].begin(tid, peers[1], [1], 10)
    push_all(senders[1], tid, ranks[1], [7, 2], 0, 30, first_tokens=(5,))
    assert [c.transfer_id for c in wait_events(receiver).completed] == [tid]
    want = expected(senders[0], ranks[0], [4, 5], 30, dst, [1])
    want = expected(senders[1], ranks[1], [7, 2], 30, dst, [1], base=want)
    np.testing.assert_array_equal(region_bytes(receiver._cache).numpy(), want)


def test_one_prefill_rank_splits_heads_over_two_decode_ranks(hub, closing):
    src = layout(16)
    dsts = [layout(16, blocks=6, heads=2, tp_rank=r, tp_size=2) for r in (0, 1)]
    sender = closing(make_sender("inproc", hub, "P", src))
    receivers = [closing(make_receiver("inproc", hub, f"D{r}", dsts[r])) for r in (0, 1)]
    for r in (0, 1):
        peer = meet(sender, receivers[r])
        tid = receivers[r].expect([5 - r], lease_s=10)
        sender.begin(tid, peer, [5 - r], 10)
        push_all(sender, tid, src, [2], 0, 16)
        assert [c.transfer_id for c in wait_events(receivers[r]).completed] == [tid]
        np.testing.assert_array_equal(
            region_bytes(receivers[r]._cache).numpy(), expected(sender, src, [2], 16, dsts[r], [5 - r])
        )


def test_transfer_id_the_receiver_never_issued_is_dropped_and_counted(hub, closing):
    src = layout()
    sender, receiver = closing(make_sender("inproc", hub, "P", src)), closing(make_receiver("inproc", hub, "D", src))
    peer = meet(sender, receiver)
    sender.begin("D-forged", peer, [0], 10)
    push_all(sender, "D-forged", src, [1], 0, 16)
    failed = wait_events(sender).failed
    assert [(f.transfer_id, f.reason) for f in failed] == [("D-forged", "unknown or expired transfer id")]
    assert receiver.counters()["dropped_unknown"] == 3 + 1  # three layers and the Done notice
    assert not region_bytes(receiver._cache).numpy().any()


def test_transfer_arriving_after_its_lease_expired_is_dropped(hub, closing):
    src = layout()
    sender, receiver = closing(make_sender("inproc", hub, "P", src)), closing(make_receiver("inproc", hub, "D", src))
    peer = meet(sender, receiver)
    tid = receiver.expect([0], lease_s=0.05)
    assert [(f.reason, f.outcome) for f in wait_events(receiver).failed] == [
        ("lease expired before the KV arrived", "lease_expired")
    ]
    sender.begin(tid, peer, [0], 10)
    push_all(sender, tid, src, [1], 0, 16)
    assert wait_events(sender).failed  # refused (cancelled or unknown id), never applied
    assert receiver.counters()["dropped_unknown"] == 0
    assert not region_bytes(receiver._cache).numpy().any()


def rogue_pair(hub, closing, dst):
    """A receiver and a bare backend that breaks the protocol at will."""
    receiver = closing(make_receiver("inproc", hub, "D", dst))
    rogue = InprocBackend("rogue", hub)
    rogue.register("kv", torch.ones(dst.shape))
    receiver.accept(make_sender("inproc", InprocHub(), "rogue", dst).hello())
    rogue.connect("D", receiver.backend.metadata())
    return receiver, rogue


def test_checksum_mismatch_is_refused(hub, closing):
    dst = layout()
    receiver, rogue = rogue_pair(hub, closing, dst)
    tid = receiver.expect([2], lease_s=10)
    off = np.array([dst.chunk_offsets(0, 2)]), np.array([dst.block_bytes])
    rogue.write("D", tid, 0, "kv", off[0], off[0], off[1])
    rogue.send_notice("D", encode(Done(tid, "rogue", (1,), 0, 16, (0, 1, 2, 3), 12345, "all")))
    (failed,) = wait_events(receiver).failed
    assert failed.transfer_id == tid and failed.reason.startswith("checksum mismatch")
    assert failed.outcome == "checksum_mismatch"
    assert receiver.counters()["checksum_failures"] == 1


@pytest.mark.parametrize("first_tokens", [(), tuple(range(17)), (3, -1), (1 << 31,)])
def test_a_notice_without_one_valid_first_token_per_sequence_is_refused(hub, closing, first_tokens):
    receiver, rogue = rogue_pair(hub, closing, layout())
    tid = receiver.expect([2], lease_s=10)
    rogue.send_notice("D", encode(Done(tid, "rogue", first_tokens, 0, 16, (0, 1, 2, 3), 0, "none")))
    (failed,) = wait_events(receiver).failed
    assert (failed.transfer_id, failed.outcome) == (tid, "bad_notice")
    assert failed.reason.startswith("bad first tokens")


def test_every_sequence_s_first_token_arrives_in_the_notice(hub, closing):
    src = layout()
    sender = closing(make_sender("inproc", hub, "P", src))
    receiver = closing(make_receiver("inproc", hub, "D", src))
    peer = meet(sender, receiver)
    tid = receiver.expect([1], lease_s=10)
    sender.begin(tid, peer, [1], lease_s=10)
    push_all(sender, tid, src, [4], 0, 16, first_tokens=[9, 0, 9, 31])
    assert [(c.transfer_id, c.first_tokens) for c in wait_events(receiver).completed] == [(tid, (9, 0, 9, 31))]


def test_write_outside_the_reserved_blocks_fails_the_transfer_and_is_not_applied(hub, closing):
    dst = layout()
    receiver, rogue = rogue_pair(hub, closing, dst)
    tid = receiver.expect([2], lease_s=10)
    rogue.write("D", tid, 0, "kv", np.array([0]), np.array([dst.chunk_offsets(0, 3)]), np.array([dst.block_bytes]))
    (failed,) = wait_events(receiver).failed
    assert (failed.reason, failed.outcome) == ("'rogue' wrote outside the reserved blocks", "out_of_bounds")
    assert not region_bytes(receiver._cache).numpy().any()


def test_cancel_reports_the_transfer_failed(hub, closing):
    src = layout()
    sender, receiver = closing(make_sender("inproc", hub, "P", src)), closing(make_receiver("inproc", hub, "D", src))
    peer = meet(sender, receiver)
    tid = receiver.expect([0], lease_s=10)
    sender.begin(tid, peer, [0], 10)
    receiver.cancel(tid, "client disconnected")
    assert [(f.reason, f.outcome) for f in wait_events(receiver).failed] == [("client disconnected", "cancelled")]
    (failed,) = wait_events(sender).failed  # the Cancel may overtake begin(): both are refusals
    assert failed.transfer_id == tid and failed.reason.startswith("cancelled by the receiver")
    assert failed.outcome == "cancelled"


def test_an_abort_drops_the_pushes_queued_with_it(hub, closing):
    sender = closing(make_sender("inproc", hub, "P", layout()))
    handled = []
    sender._handle = handled.append  # only the batching is under test: nothing reaches the backend
    ids = np.arange(1)
    begin, abort = Begin("t1", "D", ids, 0.0), Abort("t1")
    keep = Push("t2", 0, ids, 0, 1, None)
    sender._handle_all([begin, Push("t1", 0, ids, 0, 1, None), keep, Push("t1", 1, ids, 0, 1, None), abort])
    assert handled == [begin, keep, abort]


def test_incompatible_prefill_is_refused_with_both_values(hub, closing):
    receiver = closing(make_receiver("inproc", hub, "D", layout()))
    sender = closing(make_sender("inproc", hub, "P", layout().replace(num_layers=2)))
    with pytest.raises(IncompatiblePeer, match="num_layers: decode has 3, prefill has 2"):
        receiver.accept(sender.hello())


def test_a_zmq_receiver_waiting_for_kv_sleeps_in_its_poller(hub, closing):
    """While a transfer is expected the receiver thread must not spin: it held
    the GIL from the decode engine and a share of a core from the prefill.
    One second of waiting costs this process a few ms of CPU, not hundreds."""
    import time

    receiver = closing(make_receiver("zmq", hub, "D", layout()))
    receiver.expect([1, 2], lease_s=30)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(1.0)
    used = time.process_time() - cpu0
    assert time.monotonic() - wall0 >= 1.0
    assert used < 0.1, f"{used:.3f} s of CPU in 1 s of waiting for KV"


def test_write_into_a_pinned_cached_prefix_block_fails_the_transfer_and_is_not_applied(hub, closing):
    dst = layout()
    receiver, rogue = rogue_pair(hub, closing, dst)
    tid = receiver.expect([3, 2], lease_s=10, writable_from=1)  # block 3 holds a cached prefix others read
    rogue.write("D", tid, 0, "kv", np.array([0]), np.array([dst.chunk_offsets(0, 3)]), np.array([dst.block_bytes]))
    (failed,) = wait_events(receiver).failed
    assert (failed.reason, failed.outcome) == ("'rogue' wrote outside the reserved blocks", "out_of_bounds")
    assert not region_bytes(receiver._cache).numpy().any()
    with pytest.raises(ValueError, match="writable_from 2"):
        receiver.expect([3, 2], lease_s=10, writable_from=2)


def test_a_name_met_moments_ago_stays_bound_while_its_connection_is_being_set_up(hub, closing):
    """The receiver answers a hello before the sender connects (ZeroMQ connects in the background):
    a second hello under that name in the meantime is refused, not taken for a restart."""
    src = layout()
    receiver = closing(make_receiver("zmq", hub, "D", src))
    real = closing(make_sender("zmq", hub, "P", src))
    receiver.accept(real.hello())  # met; real has not connected (no connect() with the answer yet)
    impostor = closing(make_sender("zmq", hub, "P", src))
    with pytest.raises(PeerBound, match="'P' is bound to another instance"):
        receiver.accept(impostor.hello())


def test_a_second_instance_under_a_bound_name_is_refused_while_the_first_is_connected(hub, closing):
    """Only a restarted prefill server may take its name over: one holding the internal secret
    cannot unbind the live one by sending a hello under its name."""
    src = layout()
    receiver = closing(make_receiver("zmq", hub, "D", src))
    real = make_sender("zmq", hub, "P", src)
    peer = meet(real, receiver)
    assert meet(real, receiver) == peer  # the same instance meeting again (a retried handshake)
    impostor = closing(make_sender("zmq", hub, "P", src))
    with pytest.raises(PeerBound, match="'P' is bound to another instance"):
        receiver.accept(impostor.hello())
    assert receiver.counters()["hello_refused_bound"] == 1
    tid = receiver.expect([5], lease_s=10)
    real.begin(tid, peer, [5], 10)
    push_all(real, tid, src, [2], 0, 16)
    assert [c.transfer_id for c in wait_events(receiver).completed] == [tid]  # the live binding still works

    real.close()  # gone: once the receiver sees its connection drop, a restarted P is met
    restarted = closing(make_sender("zmq", hub, "P", src))
    met = []

    def meets() -> bool:
        try:
            met.append(meet(restarted, receiver))
        except PeerBound:
            return False
        return True

    wait_until(meets, 5.0, "the restarted P is met once the first one's connection is gone")
    peer = met[0]
    tid = receiver.expect([7], lease_s=10)
    restarted.begin(tid, peer, [7], 10)
    push_all(restarted, tid, src, [2], 0, 16)
    assert [c.transfer_id for c in wait_events(receiver).completed] == [tid]


def test_one_connection_covers_heads_once_whatever_sender_names_its_notices_claim(hub, closing):
    receiver, rogue = rogue_pair(hub, closing, layout())
    tid = receiver.expect([2], lease_s=10)
    rogue.send_notice("D", encode(Done(tid, "rank-0", (1,), 0, 16, (0, 1), 0, "none")))
    rogue.send_notice("D", encode(Done(tid, "rank-1", (1,), 0, 16, (2, 3), 0, "none")))
    (failed,) = wait_events(receiver).failed
    assert (failed.transfer_id, failed.outcome, failed.reason) == (
        tid,
        "bad_notice",
        "'rogue' already sent its Done notice",
    )


@pytest.mark.parametrize("kind", ["inproc", "zmq"])
@pytest.mark.parametrize("checksum", ["all", "sampled"])
def test_a_window_layer_sent_from_a_later_token_arrives_verified_and_writes_nothing_before(
    kind, checksum, hub, closing
):
    src, dst = layout(16), layout(32, blocks=8)
    sender = closing(make_sender(kind, hub, "P", src, checksum=checksum))
    receiver = closing(make_receiver(kind, hub, "D", dst))
    sender._cache.copy_(torch.randn(src.shape))
    peer = meet(sender, receiver)
    tid = receiver.expect([6, 2], lease_s=10)
    sender.begin(tid, peer, [6, 2], lease_s=10)
    starts = (0, 34, 0)  # layer 1 slides: only its last 7 tokens are pushed
    for first, end in ((0, 20), (20, 41)):  # two chunks; layer 1's first push is empty
        for layer, start in enumerate(starts):
            sender.push_layer(tid, layer, [3, 0, 9], max(first, start), end)
    sender.finish(tid, (5,))
    got = wait_events(receiver)
    assert [(c.transfer_id, c.first_tokens) for c in got.completed] == [(tid, (5,))], got
    assert sender.stats()["bytes"] == (41 + 7 + 41) * 2 * 4 * 8 * 4  # layer tokens x K,V x heads x dim x 4 B
    s, d = sender._cache, receiver._cache
    for layer, start in enumerate(starts):
        for p in range(41):
            want = s[layer, :, [3, 0, 9][p // 16], p % 16] if p >= start else torch.zeros_like(s[0, :, 0, 0])
            assert torch.equal(d[layer, :, [6, 2][p // 32], p % 32], want), (layer, p)


def test_a_notice_claiming_a_window_layer_from_earlier_than_it_was_written_is_refused(hub, closing):
    dst = layout()
    receiver, rogue = rogue_pair(hub, closing, dst)
    kv = torch.randn(dst.shape)
    rogue.register("kv", kv)
    tid = receiver.expect([2], lease_s=10)
    for layer in range(3):  # layer 1 written for tokens 8..16 only
        first = 8 if layer == 1 else 0
        off = np.array([dst.vector_offsets(kv, 2, first, 0) + layer * dst.layer_bytes for kv in (0, 1)])
        rogue.write("D", tid, layer, "kv", off, off, np.full(2, (16 - first) * dst.num_heads * dst.vec_bytes))
    pos = checksum_positions(tid, 16, 0, 16, "all")
    region = region_bytes(kv)
    honest = kv_checksum(region, dst, [2], pos, (0, 1, 2, 3), (0, 8, 0))
    claims_all = kv_checksum(region, dst, [2], pos, (0, 1, 2, 3))
    rogue.send_notice("D", encode(Done(tid, "rogue", (1,), 0, 16, (0, 1, 2, 3), claims_all, "all")))
    (failed,) = wait_events(receiver).failed
    assert (failed.transfer_id, failed.outcome) == (tid, "checksum_mismatch")
    tid = receiver.expect([2], lease_s=10)
    rogue.send_notice("D", encode(Done(tid, "rogue", (1,), 0, 16, (0, 1, 2, 3), honest, "all", (0, 8))))
    (failed,) = wait_events(receiver).failed
    assert (failed.outcome, failed.reason) == ("bad_notice", "layer starts (0, 8) do not fit the layers")
    tid = receiver.expect([2], lease_s=10)
    rogue.send_notice("D", encode(Done(tid, "rogue", (1,), 0, 16, (0, 1, 2, 3), honest, "all", (0, 17, 0))))
    (failed,) = wait_events(receiver).failed
    assert failed.outcome == "bad_notice"


def latent_layout(bs: int, blocks: int, tp_rank: int = 0, tp_size: int = 1, order: str = "NHD") -> KVLayout:
    """A latent cache as engine/kv_cache.py lays it out: one head of L / 2 = 20 values, held by every rank."""
    return KVLayout.for_engine_cache(
        num_layers=3,
        num_blocks=blocks,
        block_size=bs,
        num_kv_heads=1,
        head_dim=20,
        dtype="float32",
        num_kv_heads_total=1,
        head_ids=(0,),
        tp_rank=tp_rank,
        tp_size=tp_size,
    ).replace(order=order)


def test_one_prefill_rank_writes_the_whole_latent_into_each_of_two_decode_ranks(hub, closing):
    src = latent_layout(16, 8)
    dsts = [latent_layout(4, 16, tp_rank=r, tp_size=2, order="HND") for r in (0, 1)]
    assert [(r.src_rank, r.dst_rank, r.heads) for r in route_heads([src], dsts)] == [(0, 0, (0,)), (0, 1, (0,))]
    sender = closing(make_sender("inproc", hub, "P", src, checksum="all"))
    sender._cache.copy_(torch.randn(src.shape))
    receivers = [closing(make_receiver("inproc", hub, f"D{r}", dsts[r])) for r in (0, 1)]
    src_blocks, dst_blocks = [5, 2], [[9, 3, 4, 7, 11, 1, 0, 8], [2, 14, 6, 5, 13, 12, 10, 15]]
    for r in (0, 1):
        peer = meet(sender, receivers[r])
        tid = receivers[r].expect(dst_blocks[r], lease_s=10)
        sender.begin(tid, peer, dst_blocks[r], 10, heads=(0,))
        push_all(sender, tid, src, src_blocks, 0, 30)
        assert [c.transfer_id for c in wait_events(receivers[r]).completed] == [tid]
    assert sender.stats()["bytes"] == 2 * 30 * 3 * 40 * 4  # two routes x tokens x layers x L values x 4 B
    for r in (0, 1):
        np.testing.assert_array_equal(
            region_bytes(receivers[r]._cache).numpy(), expected(sender, src, src_blocks, 30, dsts[r], dst_blocks[r])
        )
