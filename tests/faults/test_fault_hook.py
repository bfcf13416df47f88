"""The fault-injection hook itself: off unless configured, deterministic when on,
and its wire faults seen by a real KVSender/KVReceiver pair (in process)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from deploy.config import parse_config
from kvlink.faulty_backend import FaultyBackend
from server_common.faults import FaultInjector, FaultPlan
from tests.support.configs import BASE, error_of
from tests.transfer.helpers import make_receiver, push_all, wait_events
from transfer.factory import make_backend
from transfer.inproc import InprocHub
from transfer.layout import KVLayout
from transfer.receiver import KVReceiver
from transfer.sender import KVSender


def test_fault_injection_is_off_by_default_and_recovery_keys_are_strict():
    cluster = parse_config(BASE, "c.yaml")
    settings = cluster.server_settings("d0", "/m")
    assert not cluster.fault_injection and not settings.fault_injection
    assert (cluster.recovery.prefill_failure, settings.lease_expiry, settings.checksum_failure) == (
        "retry",
        "fail",
        "fail",
    )
    assert "bad value 'maybe' for 'recovery.prefill_failure'" in error_of(
        {**BASE, "recovery": {"prefill_failure": "maybe"}}
    )
    assert "unknown key 'recovery.on_lease'" in error_of({**BASE, "recovery": {"on_lease": "local"}})
    on = parse_config({**BASE, "fault_injection": True, "recovery": {"lease_expiry": "local"}}, "c.yaml")
    assert on.server_settings("p0", "/m").fault_injection and on.server_settings("d0", "/m").lease_expiry == "local"


def test_counted_faults_are_consumed_one_by_one_and_a_release_keeps_them():
    faults = FaultInjector()
    faults.arm(FaultPlan(drop_notices=2, stall_after_layer=1, step_delay_s=0.5))
    faults.release()
    assert [faults.take("drop_notices") for _ in range(3)] == [True, True, False]
    status = faults.status()
    assert status.injected["notices_dropped"] == 2
    assert status.plan.stall_after_layer is None and status.plan.step_delay_s == 0.0


def test_a_stall_happens_once_at_its_layer_until_released():
    faults = FaultInjector()
    faults.arm(FaultPlan(stall_after_layer=1))
    faults.stall(0)  # not its layer: returns at once
    engine = threading.Thread(target=faults.stall, args=(1,))
    engine.start()
    deadline = time.monotonic() + 2
    while not faults.status().stalled:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    faults.release()
    engine.join(2)
    assert not engine.is_alive() and not faults.status().stalled
    started = time.monotonic()
    faults.stall(1)  # once per arming
    assert time.monotonic() - started < 0.1


def test_a_hold_ends_by_itself_after_its_timeout():
    faults = FaultInjector()
    faults.arm(FaultPlan(hold_prefill=True, pause_timeout_s=0.2))

    async def run():
        started = time.monotonic()
        await faults.hold()
        return time.monotonic() - started

    assert 0.2 <= asyncio.run(run()) < 1.0
    assert faults.status().injected["held"] == 1 and faults.status().held == 0


def test_a_read_hold_holds_only_prefix_reads_until_released():
    faults = FaultInjector()
    faults.arm(FaultPlan(hold_reads=True, pause_timeout_s=30))

    async def run():
        await faults.hold()  # /prefill: not held by hold_reads
        read = asyncio.create_task(faults.hold_read())
        while faults.status().held_reads != 1:
            await asyncio.sleep(0.01)
        assert not read.done() and faults.status().held == 0
        faults.release()
        await asyncio.wait_for(read, 2)

    asyncio.run(run())
    status = faults.status()
    assert (status.held_reads, status.injected["reads_held"], status.injected["held"]) == (0, 1, 0)
    assert not status.plan.hold_reads


LAYOUT = KVLayout.for_engine_cache(
    num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32"
)


@pytest.fixture
def pair():
    """A sender whose backend injects faults, and a plain receiver, connected in process."""
    hub, faults = InprocHub(), FaultInjector()
    backend = FaultyBackend(make_backend("inproc", "P", hub=hub), faults)
    sender = KVSender(backend, torch.randn(LAYOUT.shape), LAYOUT, name="P", model="m")
    sender.start()
    receiver = make_receiver("inproc", hub, "D", LAYOUT)
    peer = sender.connect(receiver.accept(sender.hello()))
    yield sender, receiver, peer, faults
    sender.close()
    receiver.close()


def transfer(sender, receiver, peer, lease_s: float = 10.0) -> str:
    tid = receiver.expect([1, 2], lease_s)
    sender.begin(tid, peer, [1, 2], lease_s)
    push_all(sender, tid, LAYOUT, [3, 4], 0, 6, first_tokens=(7,))
    return tid


def test_a_dropped_notice_leaves_the_reservation_to_its_lease(pair):
    sender, receiver, peer, faults = pair
    faults.arm(FaultPlan(drop_notices=1))
    transfer(sender, receiver, peer, lease_s=0.3)
    (failed,) = wait_events(receiver).failed
    assert failed.outcome == "lease_expired"
    assert wait_events(sender).failed[0].outcome == "cancelled"


def test_a_notice_delayed_past_the_lease_is_discarded_and_counted(pair):
    sender, receiver, peer, faults = pair
    faults.arm(FaultPlan(delay_notices=1, notice_delay_s=0.6))
    transfer(sender, receiver, peer, lease_s=0.3)
    assert wait_events(receiver).failed[0].outcome == "lease_expired"
    deadline = time.monotonic() + 3
    while receiver.counters()["dropped_expired"] == 0:
        assert time.monotonic() < deadline, receiver.counters()
        time.sleep(0.02)


def test_a_write_corrupted_in_transit_fails_the_checksum():
    hub, faults = InprocHub(), FaultInjector()
    sender = KVSender(make_backend("inproc", "P", hub=hub), torch.randn(LAYOUT.shape), LAYOUT, name="P", model="m")
    receiver_backend = FaultyBackend(make_backend("inproc", "D", hub=hub), faults)
    receiver = KVReceiver(receiver_backend, torch.zeros(LAYOUT.shape), LAYOUT, name="D", model="m")
    sender.start()
    receiver.start()
    try:
        peer = sender.connect(receiver.accept(sender.hello()))
        faults.arm(FaultPlan(corrupt_writes=1))
        transfer(sender, receiver, peer)
        (failed,) = wait_events(receiver).failed
        assert failed.outcome == "checksum_mismatch" and receiver.counters()["checksum_failures"] == 1
        assert wait_events(sender).failed[0].outcome == "refused"
        assert faults.status().injected["writes_corrupted"] == 1
    finally:
        sender.close()
        receiver.close()


def test_an_open_hold_holds_the_next_n_opens_only_until_released():
    faults = FaultInjector()
    faults.arm(FaultPlan(hold_opens=1, pause_timeout_s=30))

    async def run():
        await faults.hold_read()  # /kv/read: not held by hold_opens
        first = asyncio.create_task(faults.hold_open())
        while faults.status().held_opens != 1:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(faults.hold_open(), 2)  # the count is spent: the next open goes on
        assert not first.done() and faults.status().plan.hold_opens == 0
        faults.release()
        await asyncio.wait_for(first, 2)

    asyncio.run(run())
    status = faults.status()
    assert (status.held_opens, status.injected["opens_held"], status.injected["reads_held"]) == (0, 1, 0)
