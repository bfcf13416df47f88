"""Tenants' shares of a decode server's slots (router/cluster/fair_share.py): who may take a free
slot while tenants compete, and the order admission then serves them in."""

from __future__ import annotations

import asyncio

import pytest

from engine.request import SamplingParams
from router.cluster import tenancy
from router.cluster.admission import Admission, AdmissionSettings, Slot
from router.cluster.dispatch import Dispatcher, DispatchSettings
from router.cluster.fair_share import SlotShares, Use, kept_for
from router.cluster.policies import RoundRobin
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.tenancy import ANYONE, UNATTRIBUTED, Caller, Ticket
from tests.support.fakes import FakeWorkerClient
from tests.waiting import until

HEAVY, LIGHT = Ticket("heavy", 1.0, 1), Ticket("light", 1.0, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def take(shares: SlotShares, worker: Worker, ticket: Ticket) -> None:
    """``ticket``'s tenant takes a slot, as ``Admission.claim`` counts one."""
    shares.asked(ticket)
    assert worker.has_room() and shares.may_take(worker, ticket), f"{ticket.tenant} may not take a slot"
    worker.started()
    shares.took(worker.name, ticket.tenant)


def give_back(shares: SlotShares, worker: Worker, tenant: str) -> None:
    worker.ended(freed=True)
    shares.gave_back(worker.name, tenant)


def test_a_lone_tenant_uses_every_slot():
    shares, worker = SlotShares(10.0, Clock()), Worker("d0", "decode", "u", max_inflight=4)
    for _ in range(4):
        take(shares, worker, HEAVY)
    assert worker.inflight == 4 and shares.held("d0", "heavy") == 4


def test_a_heavy_tenant_at_its_share_keeps_a_slot_free_for_a_light_one():
    clock = Clock()
    shares, worker = SlotShares(10.0, clock), Worker("d0", "decode", "u", max_inflight=2)
    take(shares, worker, HEAVY)
    take(shares, worker, HEAVY)  # alone: both slots
    clock.now += 5.0
    shares.asked(LIGHT)  # the light tenant waits
    give_back(shares, worker, "heavy")
    assert not shares.may_take(worker, HEAVY)  # at its share (1 of 2): the free slot is kept
    assert shares.may_take(worker, LIGHT)
    take(shares, worker, LIGHT)
    give_back(shares, worker, "heavy")
    assert shares.may_take(worker, HEAVY)  # below its share: it always gets that much
    take(shares, worker, HEAVY)
    clock.now += 1.0
    give_back(shares, worker, "light")
    assert not shares.may_take(worker, HEAVY) and worker.inflight == 1  # the light tenant's slot stays free
    clock.now += 10.1  # the light tenant asked nothing for a whole window: no longer active
    assert shares.may_take(worker, HEAVY)


def test_a_light_tenant_may_go_past_its_share_while_it_used_less_than_the_other():
    clock = Clock()
    shares, worker = SlotShares(10.0, clock), Worker("d0", "decode", "u", max_inflight=2)
    take(shares, worker, HEAVY)
    take(shares, worker, HEAVY)
    clock.now += 5.0
    give_back(shares, worker, "heavy")
    take(shares, worker, LIGHT)
    give_back(shares, worker, "heavy")
    # The light tenant holds its share (1) and the heavy one holds none, but it used less lately.
    assert shares.average("d0", "light") < shares.average("d0", "heavy")
    assert shares.may_take(worker, LIGHT) and shares.may_take(worker, HEAVY)


def test_two_heavy_tenants_fill_a_server_between_them():
    """Whenever a slot is free, one of them may take it: the one that used less lately."""
    clock = Clock()
    a, b = Ticket("a", 1.0, 1), Ticket("b", 1.0, 1)
    shares, worker = SlotShares(10.0, clock), Worker("d0", "decode", "u", max_inflight=4)
    for _ in range(3):
        take(shares, worker, a)
    clock.now += 5.0
    take(shares, worker, b)
    clock.now += 1.0
    give_back(shares, worker, "a")  # a: 2 (its share), b: 1
    assert (shares.may_take(worker, a), shares.may_take(worker, b)) == (False, True)
    take(shares, worker, b)
    clock.now += 1.0
    give_back(shares, worker, "b")  # a: 2, b: 1; b used less: a keeps the slot for it
    assert (shares.may_take(worker, a), shares.may_take(worker, b)) == (False, True)
    take(shares, worker, b)
    give_back(shares, worker, "a")  # a: 1, below its share
    assert shares.may_take(worker, a)
    assert worker.inflight == 3


def test_what_is_kept_for_a_tenant_follows_its_recent_peak_within_its_share():
    assert kept_for(held=0, peak=0, share=4) == 1  # a newcomer: one slot, to find on arrival
    assert kept_for(held=1, peak=1, share=4) == 1  # never more than one at once: room for the next
    assert kept_for(held=1, peak=3, share=4) == 3  # ran 3 at once lately: room for 4 in all
    assert kept_for(held=1, peak=6, share=4) == 3  # but no more than its share
    assert kept_for(held=4, peak=6, share=4) == 1  # at its share, or past it: one, as before
    assert kept_for(held=0, peak=5, share=1) == 1


def test_a_tenants_peak_is_the_most_it_held_at_once_within_the_window():
    use = Use(at=100.0)
    for now in (100.0, 101.0, 102.0):
        use.took(now)  # 3 at once at 102
    use.held -= 2
    use.took(104.0)  # 2 at 104
    use.held -= 1
    assert use.peak(105.0, 10.0) == 3
    assert use.peak(112.5, 10.0) == 2  # the take to 3 is older than the window; the one to 2 is not
    assert use.peak(114.5, 10.0) == 1  # none within it: what it holds now
    assert list(use.tops) == []


def test_a_light_tenant_that_ran_several_at_once_lately_finds_that_many_free():
    """At 8 slots a heavy tenant at its share (4) keeps one slot free for a light tenant that never
    overlaps, but up to its recent peak plus one for one whose requests came 3 at once."""
    clock = Clock()
    shares, worker = SlotShares(10.0, clock), Worker("d0", "decode", "u", max_inflight=8)
    for _ in range(4):
        take(shares, worker, HEAVY)
    clock.now += 5.0
    for _ in range(3):
        take(shares, worker, LIGHT)  # below its share (4): it always may
    clock.now += 1.0
    give_back(shares, worker, "light")
    give_back(shares, worker, "light")  # light holds 1, ran 3 at once: 4 - 1 = 3 kept, 3 free
    assert shares.average("d0", "light") < shares.average("d0", "heavy") and shares.peak("d0", "light") == 3
    assert not shares.may_take(worker, HEAVY) and shares.may_take(worker, LIGHT)
    take(shares, worker, LIGHT)
    take(shares, worker, LIGHT)
    take(shares, worker, LIGHT)  # light at its share (4) and at most 1 kept for it now: the server is full
    assert worker.inflight == 8
    for _ in range(3):
        give_back(shares, worker, "light")
    clock.now += 10.1
    shares.asked(LIGHT)  # still active, but its 3 and 4 at once are older than the window
    assert shares.peak("d0", "light") == 1
    assert shares.may_take(worker, HEAVY)  # 3 free, one kept for the light tenant: heavy may take 2
    take(shares, worker, HEAVY)
    take(shares, worker, HEAVY)
    assert not shares.may_take(worker, HEAVY) and worker.inflight == 7


def test_shares_follow_weights_and_each_active_tenant_keeps_at_least_one():
    heavy3 = Ticket("heavy", 3.0, 1)
    active = {"heavy": heavy3, "light": LIGHT}
    assert [SlotShares.share(t, active, 8) for t in (heavy3, LIGHT)] == [6, 2]
    assert [SlotShares.share(t, active, 2) for t in (heavy3, LIGHT)] == [1, 1]
    three = {**active, "third": Ticket("third", 1.0, 1)}
    assert [SlotShares.share(t, three, 2) for t in three.values()] == [1, 1, 1]


def test_a_higher_class_is_never_held_back_for_a_lower_one():
    clock = Clock()
    vip, batch = Ticket("vip", 1.0, 0), Ticket("batch", 1.0, 2)
    shares, worker = SlotShares(10.0, clock), Worker("d0", "decode", "u", max_inflight=2)
    take(shares, worker, batch)
    take(shares, worker, batch)  # alone: both slots
    clock.now += 5.0
    shares.asked(vip)  # the vip tenant waits
    give_back(shares, worker, "batch")
    assert not shares.may_take(worker, batch)  # at its share: the slot is kept for the vip tenant
    take(shares, worker, vip)
    give_back(shares, worker, "batch")
    take(shares, worker, vip)  # the vip tenant takes both: nothing is kept for a lower class
    give_back(shares, worker, "vip")
    give_back(shares, worker, "vip")
    take(shares, worker, batch)
    assert not shares.may_take(worker, batch)  # the vip tenant, who used less, asked within the window
    clock.now += 10.1
    shares.asked(batch)
    assert shares.may_take(worker, batch)  # the vip tenant is gone: the batch one may use both


def test_no_window_or_no_limit_keeps_nothing_free():
    off, limited = SlotShares(0.0, Clock()), Worker("d0", "decode", "u", max_inflight=2)
    off.asked(LIGHT)
    take(off, limited, HEAVY)
    take(off, limited, HEAVY)
    on, unlimited = SlotShares(10.0, Clock()), Worker("d1", "decode", "u")
    on.asked(LIGHT)
    for _ in range(3):
        take(on, unlimited, HEAVY)


def admit_in_order(
    settings: AdmissionSettings, script, seen: list[Admission] | None = None
) -> tuple[list[str], list[float]]:
    """Admission in front of one 2-slot decode server; ``script(request, release)`` drives it, where
    ``request(name, ticket)`` starts a request and ``release(name)`` ends an admitted one. Returns the
    names in the order they were admitted, and each one's wait; ``seen`` gets the admission."""
    waits: list[float] = []
    admission = Admission(settings, on_wait=waits.append)
    if seen is not None:
        seen.append(admission)
    worker = Worker("d0", "decode", "u", max_inflight=2)
    admitted: list[str] = []
    slots: dict[str, Slot] = {}

    def attempt(name: str, ticket: Ticket):
        async def go() -> Slot | None:
            if not (worker.has_room() and admission.may_take(worker, ticket)):
                return None
            slots[name] = admission.claim(worker, False, ticket.tenant)
            admitted.append(name)
            return slots[name]

        return go

    async def run() -> None:
        tasks: list[asyncio.Task] = []

        async def request(name: str, ticket: Ticket) -> None:
            before = admission.waiting + len(admitted)
            tasks.append(asyncio.create_task(admission.admit(attempt(name, ticket), ticket, 10.0)))
            await until(lambda: admission.waiting + len(admitted) == before + 1, 5.0, f"{name} in or waiting")

        def all_tried() -> bool:  # every waiter tried since the last wake-up (``Admission.admit``)
            return all(w.tried == admission._round for w in admission._waiters)

        async def release(name: str) -> None:
            slots[name].release()
            await until(all_tried, 5.0, f"every waiter tried for the slot {name} freed")

        await script(request, release)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for slot in slots.values():
            slot.release()
        assert worker.inflight == 0 and admission.shares.held("d0", "heavy") == 0
        assert admission.shares.held("d0", "light") == 0

    asyncio.run(run())
    return admitted, waits


def test_a_light_request_takes_the_kept_slot_at_once_while_heavy_ones_wait():
    async def script(request, release):
        for i in range(4):
            await request(f"h{i}", HEAVY)  # h0, h1 take both slots; h2, h3 wait
        await request("l0", LIGHT)  # waits, first in fair order
        await release("h0")  # l0 takes it
        await release("l0")  # heavy holds its share (1): the slot is kept for the light tenant
        await request("l1", LIGHT)  # so the next light request finds it free, without waiting
        await release("h1")  # below its share now: the first heavy waiter goes in
        await release("l1")

    admitted, waits = admit_in_order(AdmissionSettings(poll=60), script)
    assert admitted == ["h0", "h1", "l0", "l1", "h2"]
    assert waits[3] == 0.0  # l1 was admitted at once


def test_each_request_a_share_held_back_is_counted_once_and_slots_held_per_tenant_are_known():
    holding: list[tuple[int, int]] = []
    seen: list[Admission] = []

    async def script(request, release):
        def held() -> None:
            shares = seen[0].shares
            holding.append((shares.holding("heavy"), shares.holding("light")))

        for i in range(4):
            await request(f"h{i}", HEAVY)  # h2, h3 wait: the server is full, no share holds them back
        await request("l0", LIGHT)
        held()
        await release("h0")  # l0 takes it
        held()
        await release("l0")  # the slot is kept for the light tenant: h2 and h3 held back, once each
        await release("h1")  # h2 goes in, below its share; h3 stays held back (counted already)
        held()

    admitted, _ = admit_in_order(AdmissionSettings(poll=60), script, seen)
    assert admitted == ["h0", "h1", "l0", "h2"]
    assert holding == [(2, 0), (1, 1), (1, 0)]
    assert seen[0].held_back == {"heavy": 2}


def test_without_shares_a_heavy_waiter_takes_every_slot_that_frees():
    async def script(request, release):
        for i in range(4):
            await request(f"h{i}", HEAVY)
        await request("l0", LIGHT)
        await release("h0")
        await release("l0")  # h2 takes it
        await request("l1", LIGHT)  # finds both slots taken: waits
        await release("h1")  # l1 first in fair order

    admitted, waits = admit_in_order(AdmissionSettings(poll=60, share_window_s=0.0), script)
    assert admitted == ["h0", "h1", "l0", "h2", "l1"]
    assert waits[4] > 0.0


def test_with_one_tenant_a_freed_slot_goes_to_the_first_waiter():
    async def script(request, release):
        for i in range(4):
            await request(f"h{i}", HEAVY)
        await release("h0")
        await release("h1")

    admitted, waits = admit_in_order(AdmissionSettings(poll=60), script)
    assert admitted == ["h0", "h1", "h2", "h3"]


def test_the_dispatcher_claims_each_slot_for_the_callers_tenant_and_gives_it_back():
    workers = [Worker("p0", "prefill", "u"), Worker("d0", "decode", "u", max_inflight=2)]
    fake = FakeWorkerClient(reply=[1, 2])
    admission = Admission(AdmissionSettings(poll=60))
    registry = WorkerRegistry(workers)
    dispatcher = Dispatcher(registry, RoundRobin(), RoundRobin(), fake, DispatchSettings(), admission=admission)
    sampling = SamplingParams(max_tokens=2, temperature=0)

    async def start(rid: str, ticket: Ticket):
        tenancy.CURRENT.set(Caller(ticket))
        return await dispatcher.start(rid, [1], sampling)

    async def finish(session) -> None:
        async for _ in session.deltas():
            pass
        await session.close()

    async def run():
        h0 = await asyncio.create_task(start("h0", HEAVY))
        h1 = await asyncio.create_task(start("h1", HEAVY))
        light = asyncio.create_task(start("l0", LIGHT))
        await until(lambda: admission.waiting == 1, 5.0, "l0 waiting")
        assert (admission.shares.held("d0", "heavy"), admission.shares.held("d0", "light")) == (2, 0)
        await finish(h0)
        l0 = await asyncio.wait_for(light, 5.0)
        assert (admission.shares.held("d0", "heavy"), admission.shares.held("d0", "light")) == (1, 1)
        await finish(h1)
        await finish(l0)

    asyncio.run(run())
    assert [req.request_id for _, req in fake.opened] == ["h0", "h1", "l0"]
    assert (admission.shares.held("d0", "heavy"), admission.shares.held("d0", "light")) == (0, 0)
    assert workers[1].inflight == 0 and admission.sessions == 0


def test_giving_back_a_slot_not_held_is_a_bug():
    shares = SlotShares(10.0, Clock())
    with pytest.raises(AssertionError):
        shares.gave_back("d0", "heavy")


def test_an_unattributed_request_is_outside_the_shares_where_anyone_keeps_a_slot_free():
    """A request whose tenant cannot be known (an adopted background response kept without one) makes no
    tenant active and holds no tenant's slot: a lone tenant uses every slot. The built-in ``ANYONE``
    ticket, by contrast, is the default tenant in the top class: a tenant at its share keeps it a slot."""
    clock = Clock()
    shares, worker = SlotShares(10.0, clock), Worker("d0", "decode", "u", max_inflight=3)
    take(shares, worker, UNATTRIBUTED)
    take(shares, worker, HEAVY)
    clock.now += 5.0
    assert shares.active() == {"heavy": HEAVY} and (shares.holding(""), shares.holding("heavy")) == (0, 1)
    assert shares.may_take(worker, HEAVY)  # alone among tenants: the last slot is its to take
    shares.asked(ANYONE)
    assert not shares.may_take(worker, HEAVY)  # at its share (1 of 3 over 2 tenants): one kept for default
    assert shares.may_take(worker, UNATTRIBUTED)  # no share holds it back
    give_back(shares, worker, "")
    assert shares.held("d0", "heavy") == 1 and worker.inflight == 1


def test_an_unattributed_request_moves_no_tenants_fair_queuing_tag():
    admission = Admission(AdmissionSettings(poll=60))
    worker = Worker("d0", "decode", "u", max_inflight=2)

    async def attempt() -> Slot:
        return admission.claim(worker, False, UNATTRIBUTED.tenant)

    slot = asyncio.run(admission.admit(attempt, UNATTRIBUTED, 100.0))
    assert admission._finish == {} and admission.shares.active() == {} and admission.held_back == {}
    slot.release()
    assert worker.inflight == 0
