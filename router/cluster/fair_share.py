"""Each tenant's share of a decode server's slots while tenants compete (docs/architecture.md).

Fair queuing (router/cluster/admission.py) decides who gets the next slot that frees. With few,
long, non-preemptible slots that is not enough: a light tenant that arrives while a heavy one holds
every slot of a server waits for one of them to end, however early its fair start tag. So while
more than one tenant asks for slots, a server's slots are shared out the way SGLang's gateway
reserves slots and llm-d's flow control keeps tenants apart:

- a tenant's **share** of a server with ``max_inflight`` L is L times its weight over the weights of
  the active tenants of its priority class and the higher ones (itself included), rounded down, at
  least 1. Below its share a tenant always takes a free slot;
- at or above its share it takes one more only if enough slots stay free on that server for each
  other active tenant (of its class or a higher one) whose recent **use** of that server, per unit of
  weight, is below its own. Use is the slots it held there, averaged exponentially over
  ``window_s``. What is kept for such a tenant follows its own bursts (``kept_for``): up to one
  more than the most it held there at once within the window, bounded by its share, and at least
  one. So a light tenant finds a slot free on arrival rather than one slot time later, and a light
  tenant whose requests overlap finds room for as many as it recently ran together, while two heavy
  tenants still fill the server between them (each lets the other, lagging one, catch up, the way
  fair queuing favours sparse flows);
- a tenant is **active** while it holds a slot or has asked for one within ``window_s``.

With one active tenant (no tenants configured, or only one sending) nothing is held back: every
slot is used. A higher class is never held back for a lower one. Whatever this allows, the server's
own "no room" answer stays the last word (``Admission.no_room``). A request whose tenant cannot be
known (``tenancy.UNATTRIBUTED``) is outside the shares: it makes no tenant active, its slots are no
tenant's, and no share holds it back.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.cluster.registry import Worker
from router.cluster.tenancy import Ticket


def kept_for(held: int, peak: int, share: int) -> int:
    """The slots kept free on a server for a tenant that used it less than the one asking: enough for
    one more request than the most it ran there at once lately (``peak``), but not past its ``share``
    of the server, and always at least one, so it finds a slot free on arrival. ``held``: what it
    holds there now."""
    return max(1, min(peak + 1, share) - held)


@dataclass
class Use:
    """One tenant's slots on one server: how many it holds now, their average over the window, and the
    most it held at once within the window."""

    held: int = 0
    average: float = 0.0
    at: float = 0.0  # when ``average`` was last brought up to date
    # (when, slots held just after a take) for takes within the window, the slots strictly decreasing:
    # a take that an equal or higher later one outlasts can never be the window's most again
    tops: deque[tuple[float, int]] = field(default_factory=deque)

    def catch_up(self, now: float, window_s: float) -> None:
        """Move ``average`` to ``now``: ``held`` was constant since ``at``, so the exponential
        average relaxes towards it exactly."""
        if now > self.at:
            self.average = self.held + (self.average - self.held) * math.exp(-(now - self.at) / window_s)
            self.at = now

    def took(self, now: float) -> None:
        """One more slot held from ``now``."""
        self.held += 1
        while self.tops and self.tops[-1][1] <= self.held:
            self.tops.pop()
        self.tops.append((now, self.held))

    def peak(self, now: float, window_s: float) -> int:
        """The most slots held at once by a take within ``window_s`` before ``now``, or now."""
        while self.tops and now - self.tops[0][0] > window_s:
            self.tops.popleft()
        return max(self.held, self.tops[0][1]) if self.tops else self.held


class SlotShares:
    """The tenants' slots per decode server and the rule above. Not thread-safe: event loop only.
    ``Admission`` owns it: ``took`` and ``gave_back`` follow its ``Slot`` claims one for one."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``window_s``: how long a tenant that stopped asking still counts, and the span of its average
        use; 0 turns shares off (fair queuing's order alone)."""
        self.window_s = window_s
        self._clock = clock
        self._asked: dict[str, tuple[float, Ticket]] = {}  # tenant -> (when it last asked, that ticket)
        self._uses: dict[tuple[str, str], Use] = {}  # (server, tenant) -> its use there
        self._holding: Counter[str] = Counter()  # tenant -> slots it holds on all servers

    def asked(self, ticket: Ticket) -> None:
        """A request of ``ticket``'s tenant asks for a slot (on arrival, and on each try while it waits)."""
        if ticket.counted:
            self._asked[ticket.tenant] = (self._clock(), ticket)

    def took(self, worker: str, tenant: str) -> None:
        if tenant:  # an unattributed request's slot is no tenant's
            self._use(worker, tenant).took(self._clock())
            self._holding[tenant] += 1

    def gave_back(self, worker: str, tenant: str) -> None:
        if not tenant:
            return
        use = self._use(worker, tenant)
        assert use.held > 0 and self._holding[tenant] > 0, f"{tenant} gave back a slot on {worker} it did not hold"
        use.held -= 1
        self._holding[tenant] -= 1

    def holding(self, tenant: str) -> int:
        """The slots ``tenant`` holds on all decode servers now."""
        return self._holding[tenant]

    def held(self, worker: str, tenant: str) -> int:
        return self._use(worker, tenant).held

    def average(self, worker: str, tenant: str) -> float:
        return self._use(worker, tenant).average

    def peak(self, worker: str, tenant: str) -> int:
        """The most slots ``tenant`` held at once on ``worker`` within the window."""
        return self._use(worker, tenant).peak(self._clock(), self.window_s)

    def may_take(self, worker: Worker, ticket: Ticket) -> bool:
        """Whether ``ticket``'s tenant may take one of ``worker``'s free slots now (the module's rule)."""
        limit = worker.max_inflight
        if self.window_s <= 0 or limit is None or not ticket.counted:
            return True
        active = self.active()
        active[ticket.tenant] = ticket
        rivals = [t for t in active.values() if t.tenant != ticket.tenant and t.rank <= ticket.rank]
        if not rivals:
            return True
        mine = self._use(worker.name, ticket.tenant)
        if mine.held < self.share(ticket, active, limit):
            return True
        pace = mine.average / ticket.weight
        keep = 0
        for rival in rivals:
            use = self._use(worker.name, rival.tenant)
            if use.average / rival.weight < pace:
                peak = use.peak(self._clock(), self.window_s)
                keep += kept_for(use.held, peak, self.share(rival, active, limit))
        return limit - worker.inflight - 1 >= keep

    def active(self) -> dict[str, Ticket]:
        """The tenants that hold a slot or asked for one within the window, each with its last ticket."""
        now = self._clock()
        return {
            name: ticket
            for name, (at, ticket) in self._asked.items()
            if now - at <= self.window_s or self._holding[name] > 0
        }

    @staticmethod
    def share(ticket: Ticket, active: dict[str, Ticket], limit: int) -> int:
        """``ticket``'s tenant's share of ``limit`` slots against the ``active`` tenants of its class
        and of the higher ones (those it makes room for)."""
        weights = ticket.weight + sum(
            t.weight for t in active.values() if t.rank <= ticket.rank and t.tenant != ticket.tenant
        )
        return max(1, math.floor(limit * ticket.weight / weights + 1e-9))

    def _use(self, worker: str, tenant: str) -> Use:
        now = self._clock()
        use = self._uses.get((worker, tenant))
        if use is None:
            use = self._uses[(worker, tenant)] = Use(at=now)
        if self.window_s > 0:
            use.catch_up(now, self.window_s)
        return use
