"""transfer/zmq_backend.py: two ZeroMQ backends on 127.0.0.1 (a receiver's ROUTER on a free port, a
sender's DEALER), met as the handshake meets them: a write lands where it was sent, notices go both
ways, what the reservation does not allow or a stranger sends is dropped, a peer that vanishes is
reported."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from tests.waiting import wait_until
from transfer.backend import Dropped, NoticeIn, PeerLost, TransferError, WriteIn
from transfer.zmq_backend import ZmqBackend

REGION = 64  # bytes in each side's "kv" region


class Side:
    """A backend and everything its polls returned so far."""

    def __init__(self, backend: ZmqBackend, cache: torch.Tensor) -> None:
        self.backend = backend
        self.cache = cache
        self.backend.register("kv", cache)
        self.seen: list = []
        self.closed = False

    def close(self) -> None:
        """Once, whoever asks first: a test that makes it vanish, or the fixture."""
        if not self.closed:
            self.closed = True
            self.backend.close()

    def poll_until(self, predicate, what: str) -> None:
        def got() -> bool:
            self.seen += self.backend.poll(0.02)
            return predicate(self.seen)

        wait_until(got, timeout=5.0, what=what)

    def of(self, kind: type) -> list:
        return [item for item in self.seen if isinstance(item, kind)]


@pytest.fixture
def pair():
    """(sender p0, receiver d0), met; the receiver accepts writes of transfer t1 up to 16 bytes."""
    receiver = Side(
        ZmqBackend("d0", endpoint="tcp://127.0.0.1:0", connect_timeout_s=2.0), torch.zeros(REGION, dtype=torch.uint8)
    )
    sender = Side(ZmqBackend("p0", connect_timeout_s=2.0), torch.arange(REGION, dtype=torch.uint8))
    receiver.backend.set_write_limit(lambda tid: 16 if tid == "t1" else None)
    receiver.backend.connect("p0", sender.backend.metadata())
    sender.backend.connect("d0", receiver.backend.metadata_for("p0"))
    yield sender, receiver
    sender.close()
    receiver.close()


def write(sender: Side, tid: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
    handle = sender.backend.write("d0", tid, 1, "kv", np.array(src), np.array(dst), np.array(lengths))
    wait_until(lambda: sender.backend.write_done(handle), timeout=5.0, what="the write left the sender")


def test_a_write_lands_at_its_destination_offsets_and_notices_go_both_ways(pair):
    sender, receiver = pair
    write(sender, "t1", src=[8, 32], dst=[0, 40], lengths=[4, 8])
    receiver.poll_until(lambda seen: any(isinstance(i, WriteIn) for i in seen), "the write arrived")
    [landed] = receiver.of(WriteIn)
    assert (landed.peer, landed.transfer_id, landed.layer) == ("p0", "t1", 1)
    assert landed.dst_offsets.tolist() == [0, 40] and landed.lengths.tolist() == [4, 8]
    receiver.backend.apply(landed)
    expected = torch.zeros(REGION, dtype=torch.uint8)
    expected[0:4] = torch.arange(8, 12)
    expected[40:48] = torch.arange(32, 40)
    assert torch.equal(receiver.cache, expected)

    sender.backend.send_notice("d0", b"done t1")
    receiver.poll_until(lambda seen: receiver.of(NoticeIn), "the sender's notice arrived")
    assert receiver.of(NoticeIn) == [NoticeIn("p0", b"done t1")]
    receiver.backend.send_notice("p0", b"ack t1")
    sender.poll_until(lambda seen: sender.of(NoticeIn), "the receiver's notice arrived")
    assert sender.of(NoticeIn) == [NoticeIn("d0", b"ack t1")]
    assert receiver.backend.peer_connected("p0")


def test_a_write_for_no_reservation_or_past_its_size_is_dropped_unread(pair):
    sender, receiver = pair
    write(sender, "t9", src=[0], dst=[0], lengths=[4])
    write(sender, "t1", src=[0], dst=[0], lengths=[17])
    write(sender, "t1", src=[0], dst=[0], lengths=[16])  # the limit exactly: taken
    receiver.poll_until(lambda seen: receiver.of(WriteIn), "the allowed write arrived")
    assert receiver.of(Dropped) == [Dropped("p0", "unknown_transfer", "t9"), Dropped("p0", "oversized", "t1")]
    assert [w.lengths.tolist() for w in receiver.of(WriteIn)] == [[16]]
    assert torch.equal(receiver.cache, torch.zeros(REGION, dtype=torch.uint8))  # nothing applied by itself


def test_frames_from_an_identity_the_handshake_did_not_assign_are_dropped(pair):
    _, receiver = pair
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.IDENTITY, b"p0")  # claims a bound peer's name, not its token
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(receiver.backend.endpoint)
    try:
        stranger.send(b"done t1")
        receiver.poll_until(lambda seen: receiver.of(Dropped), "the stranger's frame was read")
        assert receiver.of(Dropped) == [Dropped(b"p0".hex(), "unbound_identity")]
        assert receiver.of(NoticeIn) == []
    finally:
        stranger.close(linger=0)
        ctx.term()


def test_a_receiver_that_vanishes_is_reported_and_later_writes_to_it_fail(pair):
    sender, receiver = pair
    write(sender, "t1", src=[0], dst=[0], lengths=[4])  # connected
    receiver.close()
    sender.poll_until(lambda seen: sender.of(PeerLost), "the sender saw the connection drop")
    assert sender.of(PeerLost) == [PeerLost("d0")]
    with pytest.raises(TransferError, match="'d0' dropped"):
        sender.backend.write("d0", "t1", 1, "kv", np.array([0]), np.array([0]), np.array([4]))


def test_a_sender_that_vanishes_is_no_longer_connected_and_notices_to_it_fail(pair):
    sender, receiver = pair
    write(sender, "t1", src=[0], dst=[0], lengths=[4])
    receiver.poll_until(lambda seen: receiver.of(WriteIn), "the sender connected")
    sender.close()
    wait_until(lambda: not receiver.backend.peer_connected("p0"), timeout=5.0, what="the ROUTER saw p0 go")
    with pytest.raises(TransferError, match="cannot reach 'p0'"):
        receiver.backend.send_notice("p0", b"ack")


def test_a_hello_for_another_name_or_without_an_identity_is_refused():
    receiver = ZmqBackend("d0", endpoint="tcp://127.0.0.1:0")
    sender = ZmqBackend("p0")
    try:
        with pytest.raises(ValueError, match="not for 'd1'"):
            sender.connect("d1", receiver.metadata_for("p0"))
        with pytest.raises(ValueError, match="assigned us no connection identity"):
            sender.connect("d0", receiver.metadata_for("p0"))  # the receiver never met p0
        with pytest.raises(TransferError, match="not connected to 'd0'"):
            sender.send_notice("d0", b"x")
    finally:
        sender.close()
        receiver.close()
