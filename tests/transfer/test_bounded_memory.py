"""What the transfer layer remembers about ended transfers stays within its bound, however many end."""

from __future__ import annotations

import transfer.sender
from tests.transfer.helpers import make_receiver, make_sender, wait_events
from transfer.backend import NoticeIn
from transfer.inproc import InprocHub
from transfer.integrity import IssuedTransfers
from transfer.layout import KVLayout
from transfer.messages import Cancel, encode
from transfer.outcome import Outcome
from transfer.recent import RecentIds
from transfer.sender import Begin


def test_recent_ids_keep_the_newest_capacity_ids_and_forget_the_oldest():
    ids = RecentIds(3)
    for i in range(5):
        ids.add(f"t{i}")
    assert len(ids) == 3
    assert [f"t{i}" in ids for i in range(5)] == [False, False, True, True, True]


def test_recent_ids_readding_an_id_makes_it_the_newest():
    ids = RecentIds(2)
    ids.add("a")
    ids.add("b")
    ids.add("a")  # "b" is now the oldest
    ids.add("c")
    assert len(ids) == 2 and "a" in ids and "c" in ids and "b" not in ids


def test_the_sender_remembers_at_most_its_bound_of_cancelled_transfers(monkeypatch):
    monkeypatch.setattr(transfer.sender, "REMEMBER_CANCELLED", 3)
    layout = KVLayout.for_engine_cache(
        num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=4, dtype="float32"
    )
    sender = make_sender("inproc", InprocHub(), "p0", layout)
    sender.close()  # the thread is stopped: the test drives the transfer thread's handlers itself
    for i in range(5):  # cancels of transfers it never began, from a receiver it never met
        sender._on_incoming(NoticeIn("d0", encode(Cancel(f"t{i}"))))
    assert sender.remembered_cancels() == 3
    for tid in ("t0", "t4"):
        sender._handle(Begin(tid, "d0", None, 0.0))
    ended = {e.transfer_id: e.outcome for e in sender.take_finished()}
    # t0 was forgotten: refused for the peer it never met, not as cancelled
    assert ended == {"t0": Outcome.TRANSPORT, "t4": Outcome.CANCELLED}
    assert sender.open_transfers() == 0


def test_the_receiver_remembers_at_most_its_bound_of_ended_transfer_ids():
    issued = IssuedTransfers("d0", remember=3)
    tids = [issued.issue([1, 2], lease_s=10.0) for _ in range(5)]
    for tid in tids:
        issued.end(tid, ok=True)
    assert [issued.live(tid) for tid in tids] == [None] * 5
    for tid in tids:  # a late write for each: the three newest ended, the two oldest are forgotten
        issued.count_drop(tid)
    assert (issued.counters["dropped_expired"], issued.counters["dropped_unknown"]) == (3, 2)


def test_a_receiver_holds_no_transfer_once_every_one_it_expected_ended():
    layout = KVLayout.for_engine_cache(
        num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=4, dtype="float32"
    )
    receiver = make_receiver("inproc", InprocHub(), "d0", layout)
    try:
        tids = [receiver.expect([i], lease_s=30.0) for i in range(3)]
        assert receiver.open_transfers() == 3
        for tid in tids:
            receiver.cancel(tid, "client disconnected")
        assert len(wait_events(receiver, count=3).failed) == 3
        assert receiver.open_transfers() == 0
    finally:
        receiver.close()
