"""Admission control: per-worker in-flight limits and a bounded waiting room.

A request is admitted when some decode server in rotation has a free slot
(``Worker.inflight < Worker.max_inflight``) and, if it needs a prefill
server, the prefill servers in rotation have one too. Otherwise it waits
here, at most ``max_queued_requests`` requests at a time and at most
``timeout`` seconds each, admitted in the order of their tickets: priority
class first, then weighted fair queuing between tenants (router/cluster/tenancy.py);
with no tenants configured, in arrival order. While tenants compete, a tenant
holding its share of a decode server's slots leaves one free there for each
tenant that used less (router/cluster/fair_share.py), so a light tenant finds a
slot on arrival. A request that finds the waiting room full, or waits too long,
is refused at once with 429 and a Retry-After: overload is a fast, clear answer,
never a 5xx, and the router's memory stays bounded by (slots + waiting room)
requests. 503 is kept for "no server in rotation".

Waiters wake when a slot frees (a request attempt ended, so blocks were
freed too) and at least every ``poll`` seconds, for what the router learns
only by asking: a worker back in rotation, or a decode server that said "no
room" (its KV cache was full) and whose short cool-down passed.

This class is the one owner of the router's load counters: each worker's
``inflight`` and ``inflight_tokens``, ``full_until``, the prefill slots and
the count of open sessions. Everyone else claims and releases through it: a
``Slot`` (one request attempt's claim, released once on every path), a
``prefilling`` block, ``session_started`` / ``session_ended``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

from router.cluster.fair_share import SlotShares
from router.cluster.registry import Worker
from router.cluster.tenancy import ANYONE, Ticket
from router.errors import OpenAIError
from router.settings import RouterSettings

T = TypeVar("T")


@dataclass(frozen=True)
class AdmissionSettings:
    # requests waiting for a slot; one more gets 429 at once
    max_queued_requests: int = RouterSettings.max_queued_requests
    queue_timeout_s: float = RouterSettings.queue_timeout_s  # the longest a request waits for a slot before 429
    retry_after_s: float = RouterSettings.retry_after_s  # seconds, sent in Retry-After with every 429
    poll: float = 0.25  # waiters also re-try this often (a worker back in rotation, a "no room" cooled down)
    # how long a tenant that stopped asking still has slots kept for it, and the span of each tenant's
    # average use of a server (router/cluster/fair_share.py); 0: no shares, fair queuing's order alone
    share_window_s: float = RouterSettings.tenant_share_window_s


@dataclass
class Asking:
    """One request's tries for a slot (``Admission.admit``): whether the current try found a free slot its
    tenant's share left for other tenants, and whether the request was counted as held back already."""

    refused: bool = False
    counted: bool = False


# The request whose try runs now, in its own task: ``may_take`` notes a share's refusal on it.
_ASKING: ContextVar[Asking | None] = ContextVar("pdserve_asking", default=None)


def overloaded(message: str, retry_after: float) -> OpenAIError:
    return OpenAIError(429, message, code="overloaded", retry_after=retry_after)


class Admission:
    """Slots given out and the waiting room. Not thread-safe: event loop only.

    A decode slot is ``Worker.inflight`` of a decode server (one per request
    attempt); a prefill slot is one of ``prefills_pending`` (one per admitted
    request until its first prefill ended), checked against the sum of the
    prefill servers' limits."""

    def __init__(self, settings: AdmissionSettings, on_wait: Callable[[float], None] | None = None) -> None:
        """``on_wait(seconds)``: called once per admitted request with the time it waited (0: at once)."""
        self.settings = settings
        self._on_wait = on_wait
        self.refused = 0  # requests answered 429 so far
        # per tenant: requests that found a free decode slot kept for other tenants by its share (once each)
        self.held_back: Counter[str] = Counter()
        self.sessions = 0  # admitted requests not closed yet (a draining router waits for 0)
        self.prefills_pending = 0  # admitted requests for a prefill server whose first prefill has not ended
        self._waiters: set[Waiter] = set()  # requests in the waiting room
        self._seq = 0
        self._tick: asyncio.TimerHandle | None = None  # the next poll, while requests wait
        self._virtual = 0.0  # fair queuing's virtual time: the start tag of the last admitted request
        self._finish: dict[str, float] = {}  # each tenant's last finish tag (configured tenants only)
        self.shares = SlotShares(settings.share_window_s)  # each tenant's slots on each decode server
        self._round = 0  # wake-ups so far: a waiter that tried in the current one found nothing it may take

    # ---- slots ------------------------------------------------------------------
    def prefill_is_full(self, prefill_workers: list[Worker]) -> bool:
        """Every prefill server in rotation has a limit and together they are at it."""
        limits = [w.max_inflight for w in prefill_workers if w.max_inflight is not None]
        if not limits or len(limits) < len(prefill_workers):
            return False  # none in rotation is the prefill call's own error; no limit, no slot
        return self.prefills_pending >= sum(limits)

    def may_take(self, worker: Worker, ticket: Ticket) -> bool:
        """``ticket``'s tenant may take one of ``worker``'s free slots: below its share, or leaving free
        what is kept for each tenant that used less, one or up to its recent peak plus one
        (router/cluster/fair_share.py). A refusal is noted on the request trying (``held_back``)."""
        allowed = self.shares.may_take(worker, ticket)
        asking = _ASKING.get()
        if not allowed and asking is not None:
            asking.refused = True
        return allowed

    def claim(self, worker: Worker, prefill_slot: bool, tenant: str = ANYONE.tenant) -> Slot:
        """A slot on decode server ``worker`` for ``tenant``, and one of the prefill slots with ``prefill_slot``."""
        worker.started()
        self.shares.took(worker.name, tenant)
        self.prefills_pending += prefill_slot
        return Slot(self, worker, prefill_slot, tenant)

    def no_room(self, worker: Worker, cooldown: float) -> None:
        """``worker`` said its KV cache is full: skip it for ``cooldown`` s, or until one of its slots frees."""
        worker.full_for(cooldown)

    @contextlib.contextmanager
    def prefilling(self, worker: Worker, num_tokens: int) -> Iterator[None]:
        """A prefill call on ``worker`` for the life of the block (the least-loaded policy reads these)."""
        worker.started(num_tokens)
        try:
            yield
        finally:
            worker.ended(num_tokens)

    def session_started(self) -> None:
        self.sessions += 1

    def session_ended(self) -> None:
        self.sessions -= 1

    # ---- waiting ----------------------------------------------------------------

    async def admit(self, attempt: Callable[[], Awaitable[T | None]], ticket: Ticket = ANYONE, cost: float = 1.0) -> T:
        """``attempt()`` until it returns a result (None: no slot free now).

        A request tries at once unless a waiter ahead of it has yet to try for the slots free now,
        in which case it queues behind them: a slot the waiters ahead could not take (not theirs to
        take, ``may_take``) is taken at once, not at the next wake-up. Waiting means the waiting
        room (429 when full or when the wait runs out). Waiters try in the order of their tickets:
        class first, then start-time fair queuing within the class, ``cost`` being the request's
        work (its tokens), so each tenant gets its weight's share of what is admitted. With one
        tenant that order is arrival order. A request one of whose tries found a free slot that its
        tenant's share left for others, and no other, is counted once in ``held_back``."""
        asking = Asking()
        token = _ASKING.set(asking)
        try:
            return await self._admit(attempt, ticket, cost, asking)
        finally:
            _ASKING.reset(token)

    async def _admit(
        self, attempt: Callable[[], Awaitable[T | None]], ticket: Ticket, cost: float, asking: Asking
    ) -> T:
        start = self._tag(ticket, cost)
        self.shares.asked(ticket)
        tried = -1
        if self._ahead_have_tried(ticket.rank, start):
            tried = self._round
            result = await self._try(attempt, ticket, asking)
            if result is not None:
                self._admitted(start, 0.0)
                return result
        entered = time.monotonic()
        try:
            waiter = self._enter(ticket, start, tried)
        except OpenAIError:  # refused at the door: it took none of its tenant's share
            if self._finish.get(ticket.tenant) == start + cost / ticket.weight:
                self._finish[ticket.tenant] = start
            raise
        try:
            wait = Wait(self, waiter, entered + self.settings.queue_timeout_s)
            while True:
                await wait()
                self.shares.asked(ticket)  # still asking: its tenant stays active while it waits
                waiter.tried = self._round
                result = await self._try(attempt, ticket, asking)
                if result is not None:
                    self._admitted(start, time.monotonic() - entered)
                    return result
        finally:
            self._leave(waiter)

    async def _try(self, attempt: Callable[[], Awaitable[T | None]], ticket: Ticket, asking: Asking) -> T | None:
        """One try; a try that got no slot although a share refused one counts the request held back."""
        asking.refused = False
        result = await attempt()
        if result is None and asking.refused and not asking.counted:
            asking.counted = True
            self.held_back[ticket.tenant] += 1
        return result

    def _ahead_have_tried(self, rank: int, start: float) -> bool:
        """Every waiter that a newcomer of (``rank``, ``start``) would queue behind has tried since the
        last wake-up, so whatever is free now was not theirs to take."""
        return all(w.tried == self._round for w in self._waiters if (w.rank, w.start) <= (rank, start))

    def _tag(self, ticket: Ticket, cost: float) -> float:
        """The request's fair start tag (SFQ): no earlier than the system's virtual time, nor than the
        end of its tenant's previous request; that end moves on by the request's cost over its weight.
        An uncounted request starts at the virtual time and moves no tenant's end."""
        if not ticket.counted:
            return self._virtual
        start = max(self._virtual, self._finish.get(ticket.tenant, 0.0))
        self._finish[ticket.tenant] = start + cost / ticket.weight
        return start

    def _admitted(self, start: float, waited: float) -> None:
        self._virtual = max(self._virtual, start)
        if self._on_wait is not None:
            self._on_wait(waited)

    @property
    def waiting(self) -> int:
        """Requests in the waiting room now."""
        return len(self._waiters)

    def slot_freed(self) -> None:
        """Wake every waiter to try again, in the order of their tickets: each claims its slot before
        its first await (``Dispatcher._try_open``), so the first woken takes the slot."""
        self._round += 1
        for waiter in sorted(self._waiters):
            wake(waiter.woken)

    def _enter(self, ticket: Ticket, start: float, tried: int) -> Waiter:
        """A place in the waiting room, or 429 when it is full (``start``: the fair start tag, ``admit``;
        ``tried``: the wake-up it last tried in, -1 for none).
        A full room keeps the waiters that come first: a newcomer ahead of the last one takes its place
        (that one gets the 429), so a light tenant is not refused for a heavy one's backlog."""
        self._seq += 1
        waiter = Waiter(ticket.rank, start, self._seq, asyncio.get_running_loop().create_future(), tried=tried)
        if self.waiting >= self.settings.max_queued_requests:
            last = max(self._waiters, default=None)
            if last is None or not waiter < last:
                self.refused += 1
                raise overloaded(
                    f"the server is overloaded: {self.waiting} requests are already waiting; retry later",
                    self.settings.retry_after_s,
                )
            self._waiters.discard(last)
            last.pushed_out = True
            wake(last.woken)
        self._waiters.add(waiter)
        if len(self._waiters) == 1:
            self._tick = asyncio.get_running_loop().call_later(self.settings.poll, self._poll)
        return waiter

    def _leave(self, waiter: Waiter) -> None:
        self._waiters.discard(waiter)
        if not self._waiters and self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def _poll(self) -> None:
        """Every ``poll`` s while requests wait, all of them try again, in order: what the router learns
        only by asking (a worker back in rotation, a "no room" cooled down) frees no slot."""
        self.slot_freed()
        self._tick = asyncio.get_running_loop().call_later(self.settings.poll, self._poll)


@dataclass(order=True)
class Waiter:
    rank: int  # its class (0: the highest)
    start: float  # its fair start tag
    seq: int  # arrival order, last
    woken: asyncio.Future[None] = field(compare=False)
    pushed_out: bool = field(default=False, compare=False)  # its place went to a waiter ahead of it
    tried: int = field(default=-1, compare=False)  # the wake-up (``Admission._round``) it last tried in

    def __hash__(self) -> int:
        return self.seq


class Slot:
    """One request attempt's claim on a decode server (and, for a new request
    that needs a prefill server, on one of the prefill slots). Each part is
    given back exactly once, whichever of these runs first."""

    def __init__(self, admission: Admission, worker: Worker, prefill: bool, tenant: str) -> None:
        self._admission = admission
        self.worker = worker
        self.tenant = tenant
        self._decode_held = True
        self._prefill_held = prefill

    def release_prefill(self) -> None:
        """The request's first prefill ended (or it needs none): a prefill slot is free."""
        if self._prefill_held:
            self._prefill_held = False
            self._admission.prefills_pending -= 1
            self._admission.slot_freed()

    def release(self) -> None:
        """The attempt ended on its decode server: its blocks are free, so ask that server
        again and wake the waiters. The prefill slot goes too, if still held."""
        self.release_prefill()
        if self._decode_held:
            self._decode_held = False
            self.worker.ended(freed=True)
            self._admission.shares.gave_back(self.worker.name, self.tenant)
            self._admission.slot_freed()

    def cancel(self) -> None:
        """The claim did not become an attempt (the decode server refused or was not reached):
        give both parts back without waking anyone, since nothing was freed."""
        if self._decode_held:
            self._decode_held = False
            self.worker.ended()
            self._admission.shares.gave_back(self.worker.name, self.tenant)
        if self._prefill_held:
            self._prefill_held = False
            self._admission.prefills_pending -= 1


def wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class Wait:
    def __init__(self, admission: Admission, waiter: Waiter, deadline: float) -> None:
        self._admission = admission
        self._waiter = waiter
        self._deadline = deadline

    async def __call__(self) -> None:
        """Sleep until a slot frees or the poll interval passes; 429 once waited too long, or once
        pushed out of a full room by a request ahead of it."""
        a = self._admission
        left = self._deadline - time.monotonic()
        self._check_place()
        if left <= 0:
            a.refused += 1
            raise overloaded(
                f"the server is overloaded: no capacity freed within {a.settings.queue_timeout_s:g} s; retry later",
                a.settings.retry_after_s,
            )
        woken = self._waiter.woken
        timer = asyncio.get_running_loop().call_later(left, wake, woken)
        try:
            await woken
        finally:
            timer.cancel()
            self._waiter.woken = asyncio.get_running_loop().create_future()
        self._check_place()

    def _check_place(self) -> None:
        a = self._admission
        if self._waiter.pushed_out:
            a.refused += 1
            raise overloaded(
                f"the server is overloaded: {a.settings.max_queued_requests} requests ahead of this one are "
                "waiting; retry later",
                a.settings.retry_after_s,
            )
