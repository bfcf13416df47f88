"""Tenants: keys to tenants, priority classes, rate limits; and the order admission serves waiters in."""

from __future__ import annotations

import asyncio
import math

import pytest

from router.cluster.admission import Admission, AdmissionSettings
from router.cluster.tenancy import Bucket, Tenancy, Ticket, duration
from router.errors import OpenAIError, error_response
from router.settings import DEFAULT_TENANT, TenantSettings
from tests.waiting import until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenancy(clock: Clock | None = None) -> Tenancy:
    return Tenancy(
        (
            TenantSettings("team-a", ("ka",), weight=3.0, priority="interactive", requests_per_minute=2),
            TenantSettings("batchers", ("kb1", "kb2"), priority="batch", tokens_per_minute=600),
        ),
        clock=clock or Clock(),
    )


def test_keys_find_their_tenant_and_other_keys_the_default_one():
    t = tenancy()
    assert t.tenant("ka").settings.name == "team-a"
    assert t.tenant("kb2").settings.name == "batchers"
    assert t.tenant("other").settings.name == DEFAULT_TENANT
    assert t.tenant(None).settings.name == DEFAULT_TENANT
    assert [x.ticket.rank for x in t.tenants.values()] == [0, 2, 1]  # interactive, batch, default: standard


def test_a_request_may_ask_for_a_lower_class_never_a_higher_or_an_unknown_one():
    t = tenancy()
    assert t.caller("ka", "batch").ticket == Ticket("team-a", 3.0, 2)
    assert t.caller("kb1", None).ticket == Ticket("batchers", 1.0, 2)
    with pytest.raises(OpenAIError) as higher:
        t.caller("kb1", "interactive")
    assert (higher.value.status, higher.value.code) == (403, "priority_not_allowed")
    with pytest.raises(OpenAIError) as unknown:
        t.caller("ka", "urgent")
    assert unknown.value.status == 400 and "'urgent'" in unknown.value.message
    assert unknown.value.param == "x-priority-class"


def test_requests_past_the_limit_get_429_with_retry_after_and_openai_headers():
    clock = Clock()
    t = tenancy(clock)
    t.caller("ka", None)
    t.caller("ka", None)
    with pytest.raises(OpenAIError) as over:
        t.caller("ka", None)
    err = over.value
    assert (err.status, err.code) == (429, "rate_limit_exceeded")
    assert err.retry_after == pytest.approx(30.0)  # 2 per minute: one more in 30 s
    response = error_response(err)
    assert response.headers["retry-after"] == "30"
    assert response.headers["x-ratelimit-limit-requests"] == "2"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["x-ratelimit-reset-requests"] == "1m0s"
    clock.now += 30.0
    t.caller("ka", None)  # refilled by one
    assert t.caller("other", None).tenant.settings.name == DEFAULT_TENANT  # no limit there


def test_tokens_past_the_limit_are_refused_and_a_request_larger_than_a_minute_says_so():
    clock = Clock()
    t = tenancy(clock)
    caller = t.caller("kb1", None)
    caller.take_tokens(500)
    with pytest.raises(OpenAIError) as over:
        caller.take_tokens(200)
    assert over.value.status == 429 and over.value.retry_after == pytest.approx(10.0)  # 100 missing at 10/s
    assert over.value.headers["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(OpenAIError) as huge:
        caller.take_tokens(601)
    assert huge.value.status == 429 and "more than tenant 'batchers' may use in a minute (600)" in huge.value.message
    clock.now += 60
    caller.take_tokens(600)


def test_a_router_takes_its_share_of_each_limit():
    t = Tenancy((TenantSettings("a", ("k",), requests_per_minute=10),), limit_share=0.5)
    for _ in range(5):
        t.caller("k", None)
    with pytest.raises(OpenAIError):
        t.caller("k", None)


def test_bucket_and_durations():
    b = Bucket(60, 0.0)
    assert b.take(60, 0.0) == 0 and b.take(1, 0.0) == pytest.approx(1.0) and math.isinf(b.take(61, 0.0))
    assert b.reset_s(30.0) == pytest.approx(30.0)
    assert [duration(s) for s in (0.02, 1.0, 1.2, 360.0, 61.5)] == ["20ms", "1s", "2s", "6m0s", "1m2s"]


def serve_in_order(admission: Admission, arrivals: list[tuple[str, Ticket, float]], slots: int) -> list[str]:
    """One slot is busy; ``arrivals`` queue in that order; then ``slots`` slots free one after another.
    Returns who got each one."""
    free = 0
    served: list[str] = []

    async def attempt(name: str) -> str | None:
        nonlocal free
        if free:
            free -= 1
            served.append(name)
            return name
        return None

    async def run() -> None:
        nonlocal free
        tasks = []
        for i, (name, ticket, cost) in enumerate(arrivals):
            tasks.append(asyncio.create_task(admission.admit(lambda n=name: attempt(n), ticket, cost)))
            await until(lambda i=i: admission.waiting == i + 1, 5.0, f"{name} waiting")
        for k in range(slots):
            free += 1
            admission.slot_freed()
            await until(lambda k=k: len(served) == k + 1, 5.0, "a slot taken")
        for task in tasks:
            task.cancel()  # those still waiting
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    return served


def test_waiters_of_one_tenant_are_served_in_arrival_order():
    one = Ticket("a", 1.0, 1)
    arrivals = [(f"r{i}", one, 10.0) for i in range(5)]
    assert serve_in_order(Admission(AdmissionSettings(poll=60)), arrivals, 5) == ["r0", "r1", "r2", "r3", "r4"]


def test_a_light_tenant_is_not_stuck_behind_a_heavy_tenants_backlog():
    heavy, light = Ticket("heavy", 1.0, 1), Ticket("light", 1.0, 1)
    arrivals = [(f"h{i}", heavy, 10.0) for i in range(6)] + [("l0", light, 10.0), ("l1", light, 10.0)]
    served = serve_in_order(Admission(AdmissionSettings(poll=60)), arrivals, 4)
    assert served == ["h0", "l0", "h1", "l1"]  # alternating from the light one's arrival, not after h5


def test_weights_share_the_admitted_work_and_a_higher_class_goes_first():
    a, b, vip = Ticket("a", 3.0, 1), Ticket("b", 1.0, 1), Ticket("vip", 1.0, 0)
    arrivals = [(f"b{i}", b, 10.0) for i in range(4)] + [(f"a{i}", a, 10.0) for i in range(6)] + [("v", vip, 10.0)]
    served = serve_in_order(Admission(AdmissionSettings(poll=60)), arrivals, 9)
    assert served[0] == "v"
    assert sorted(served[1:]) == ["a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1"]  # 3:1 by weight


def test_a_full_room_gives_the_last_waiters_place_to_a_newcomer_ahead_of_it():
    heavy, light = Ticket("heavy", 1.0, 1), Ticket("light", 1.0, 1)
    admission = Admission(AdmissionSettings(max_queued_requests=3, poll=60))

    async def never() -> None:
        return None

    async def run():
        heavies = []
        for i in range(3):
            heavies.append(asyncio.create_task(admission.admit(never, heavy, 10.0)))
            await until(lambda i=i: admission.waiting == i + 1, 5.0, "heavy waiting")
        with pytest.raises(OpenAIError) as full:  # behind all of them: refused at once
            await admission.admit(never, heavy, 10.0)
        lighter = asyncio.create_task(admission.admit(never, light, 10.0))
        await until(lambda: heavies[2].done(), 5.0, "the last heavy pushed out")
        pushed = heavies[2].exception()
        assert admission.waiting == 3 and not lighter.done()
        for task in [*heavies[:2], lighter]:
            task.cancel()
        await asyncio.gather(*heavies[:2], lighter, return_exceptions=True)
        return full.value, pushed

    full, pushed = asyncio.run(run())
    assert (full.status, full.code) == (429, "overloaded") and "3 requests are already waiting" in full.message
    assert isinstance(pushed, OpenAIError) and pushed.status == 429 and "ahead of this one" in pushed.message
    assert admission.waiting == 0 and admission.refused == 2


def test_a_request_refused_at_a_full_room_takes_none_of_its_tenants_share():
    heavy, light = Ticket("heavy", 1.0, 1), Ticket("light", 1.0, 1)
    admission = Admission(AdmissionSettings(max_queued_requests=1, poll=60))

    async def never() -> None:
        return None

    async def run():
        waiting = asyncio.create_task(admission.admit(never, light, 10.0))
        await until(lambda: admission.waiting == 1, 5.0, "light waiting")
        for _ in range(5):  # the heavy tenant is turned away five times
            with pytest.raises(OpenAIError):
                await admission.admit(never, heavy, 10.0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(run())
    assert admission._finish["heavy"] == 0.0  # its next request starts where it would have
