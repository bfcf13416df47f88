"""Tenants: whom a request is for, its place when the cluster is saturated, and its rate limits.

With API keys configured, every key belongs to one tenant (``router.tenants``; the keys listed
only under ``router.api_keys`` to the ``default`` tenant). A tenant has

- a **priority class** (``router.priority_classes``, highest first): a waiting request of a higher
  class is admitted before any of a lower one. A request may ask for a lower class than its
  tenant's with the ``X-Priority-Class`` header (a batch job sent with an interactive key), never
  a higher one;
- a **weight**: within a class, waiting requests are admitted in start-time fair queuing order
  (``Ticket``; router/cluster/admission.py), so that each tenant's share of the admitted work
  (prompt and output tokens) follows its weight, whatever its arrival rate;
- **rate limits**: requests and tokens per minute (a request's tokens: its prompt and ``max_tokens``
  for each of its ``n`` choices, as OpenAI counts them), token buckets refilled continuously.
  Past one, a 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers (sent with every
  answer to a tenant that has limits).

The limits are per router: with routers in front of one cluster that share the limits, each takes
its part (``limit_share``, 1 / the number of routers), so together they never allow more than the
configured rate; nothing is exchanged per request.

Only configured tenants are ever named (in metrics, in logs): a request cannot add one.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from router.errors import OpenAIError
from router.settings import DEFAULT_CLASSES, DEFAULT_TENANT, TenantSettings

PRIORITY_HEADER = "x-priority-class"


@dataclass(frozen=True)
class Ticket:
    """Who waits for a slot, and what for: admission orders waiters by (``rank``, fair start tag)."""

    tenant: str  # a configured tenant's name; "" for a request whose tenant cannot be known (``UNATTRIBUTED``)
    weight: float
    rank: int  # its class: 0 is the highest

    @property
    def counted(self) -> bool:
        """Whether the request counts toward its tenant's activity, slots and fair queuing order."""
        return bool(self.tenant)


# A request with no caller set: a stream moved to another decode server mid-answer is admitted first,
# since it is already being served.
ANYONE = Ticket(DEFAULT_TENANT, 1.0, 0)
# A request whose tenant cannot be known: a background response adopted from a router gone that kept no
# caller with it (router/api/background.py), or whose tenant this router does not configure. It counts
# toward no tenant (no slots of a share, no activity that keeps slots free for it, no fair queuing tag,
# no KV store share) and no share holds it back; already being served, it is admitted first.
UNATTRIBUTED = Ticket("", 1.0, 0)


class Bucket:
    """``per_minute`` units, refilled continuously; at most ``per_minute`` held."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.level = per_minute
        self._rate = per_minute / 60.0
        self._at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._at) * self._rate)
        self._at = now

    def take(self, n: float, now: float) -> float:
        """Take ``n`` and return 0, or take nothing and return the seconds until ``n`` are there
        (inf when ``n`` is more than the bucket holds)."""
        self._refill(now)
        if n <= self.level:
            self.level -= n
            return 0.0
        if n > self.capacity:
            return math.inf
        return (n - self.level) / self._rate

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self._refill(now)
        return (self.capacity - self.level) / self._rate


def duration(seconds: float) -> str:
    """As OpenAI writes ``x-ratelimit-reset-*``: ``20ms``, ``1s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class Tenant:
    """One configured tenant's state in this router: its buckets."""

    def __init__(self, settings: TenantSettings, rank: int, limit_share: float, now: float) -> None:
        self.settings = settings
        self.ticket = Ticket(settings.name, settings.weight, rank)
        rpm, tpm = settings.requests_per_minute, settings.tokens_per_minute
        self.requests = Bucket(rpm * limit_share, now) if rpm else None
        self.tokens = Bucket(tpm * limit_share, now) if tpm else None

    def headers(self, now: float) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, for the limits this tenant has."""
        out: dict[str, str] = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                reset = bucket.reset_s(now)
                out[f"x-ratelimit-limit-{kind}"] = str(math.floor(bucket.capacity))
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
                out[f"x-ratelimit-reset-{kind}"] = duration(reset)
        return out


@dataclass(frozen=True)
class Caller:
    """The request being served: its ticket, and the tenant whose token limit its tokens count against."""

    ticket: Ticket = ANYONE
    tenant: Tenant | None = None
    tenancy: Tenancy | None = None

    def take_tokens(self, tokens: int) -> None:
        """Count the request's tokens (its prompts, and ``max_tokens`` for each choice) or refuse it with 429."""
        if self.tenancy is not None and self.tenant is not None:
            self.tenancy.take_tokens(self.tenant, tokens)


# Set by the route before its handler runs (router/app.py ``respond``); read where the request is
# admitted (router/cluster/dispatch.py) and where its tokens are known (router/api/openai_handlers.py).
# A task the handler starts inherits it.
NOBODY = Caller()
CURRENT: ContextVar[Caller] = ContextVar("pdserve_caller", default=NOBODY)


def _digest(key: str) -> bytes:
    # Keys are looked up by digest: a dict probe on the raw secret would take time that depends on it.
    return hashlib.sha256(key.encode()).digest()


class Tenancy:
    """The router's tenants: which one a key is, the class a request runs in, the rate limits.
    Not thread-safe: event loop only."""

    def __init__(
        self,
        tenants: tuple[TenantSettings, ...],
        classes: tuple[str, ...] = DEFAULT_CLASSES,
        limit_share: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.classes = classes
        self._clock = clock
        now = clock()
        self._default_rank = len(classes) // 2
        self.tenants: dict[str, Tenant] = {}
        self._by_key: dict[bytes, Tenant] = {}
        for t in tenants:
            rank = self._default_rank if t.priority is None else classes.index(t.priority)
            tenant = Tenant(t, rank, limit_share, now)
            self.tenants[t.name] = tenant
            self._by_key.update((_digest(k), tenant) for k in t.keys)
        if DEFAULT_TENANT not in self.tenants:
            self.tenants[DEFAULT_TENANT] = Tenant(TenantSettings(DEFAULT_TENANT), self._default_rank, limit_share, now)

    def tenant(self, api_key: str | None) -> Tenant:
        """The tenant of an authenticated caller's key (``default`` for the other keys, or without keys)."""
        if api_key:
            found = self._by_key.get(_digest(api_key))
            if found is not None:
                return found
        return self.tenants[DEFAULT_TENANT]

    def caller(self, api_key: str | None, asked_class: str | None) -> Caller:
        """An authenticated request's caller, its request counted against ``requests_per_minute``
        (400 for an unknown class, 403 for one above its tenant's, 429 past its limit)."""
        tenant = self.tenant(api_key)
        ticket = self.ticket(tenant, asked_class)
        self.take_request(tenant)
        return Caller(ticket, tenant, self)

    def ticket(self, tenant: Tenant, asked: str | None) -> Ticket:
        """The request's ticket: its tenant's, in the class the ``X-Priority-Class`` header asked for."""
        if asked is None:
            return tenant.ticket
        asked = asked.strip()
        if asked not in self.classes:
            raise OpenAIError(
                400,
                f"unknown priority class {asked!r} (known: {', '.join(self.classes)})",
                param=PRIORITY_HEADER,
                code="unknown_priority_class",
            )
        rank = self.classes.index(asked)
        if rank < tenant.ticket.rank:
            raise OpenAIError(
                403,
                f"priority class {asked!r} is above this API key's {self.classes[tenant.ticket.rank]!r}",
                param=PRIORITY_HEADER,
                code="priority_not_allowed",
            )
        return Ticket(tenant.ticket.tenant, tenant.ticket.weight, rank)

    def class_of(self, ticket: Ticket) -> str | None:
        """The name of ``ticket``'s priority class (None for an uncounted ticket)."""
        return self.classes[ticket.rank] if ticket.counted else None

    def carried_on(self, tenant: str | None, priority_class: str | None) -> Caller:
        """The caller of a background response this router carries on for a router gone: the tenant and
        class kept with its request, as this router configures them (a class it does not know, or one
        now above the tenant's: the tenant's own). Its tokens were counted when it was asked, so none
        are taken again. A tenant not kept, or not configured here: ``UNATTRIBUTED``."""
        found = self.tenants.get(tenant) if tenant else None
        if found is None:
            return Caller(UNATTRIBUTED)
        rank = self.classes.index(priority_class) if priority_class in self.classes else found.ticket.rank
        return Caller(Ticket(found.ticket.tenant, found.ticket.weight, max(rank, found.ticket.rank)))

    def take_request(self, tenant: Tenant) -> None:
        """Count one request against ``requests_per_minute``, or refuse it with 429."""
        if tenant.requests is not None:
            self._take(tenant, tenant.requests, 1, "requests")

    def take_tokens(self, tenant: Tenant, tokens: int) -> None:
        """Count ``tokens`` against ``tokens_per_minute``, or refuse the request with 429."""
        if tenant.tokens is not None:
            self._take(tenant, tenant.tokens, tokens, "tokens")

    def _take(self, tenant: Tenant, bucket: Bucket, n: int, kind: str) -> None:
        now = self._clock()
        wait = bucket.take(n, now)
        if wait == 0:
            return
        name = tenant.settings.name
        per_minute = math.floor(bucket.capacity)
        if math.isinf(wait):
            message = f"the request needs {n} {kind}, more than tenant {name!r} may use in a minute ({per_minute})"
            wait = 60.0
        else:
            message = f"rate limit reached for tenant {name!r}: {per_minute} {kind} per minute; retry in {wait:.1f} s"
        raise OpenAIError(429, message, code="rate_limit_exceeded", retry_after=wait, headers=tenant.headers(now))

    def headers(self, tenant: Tenant) -> dict[str, str]:
        return tenant.headers(self._clock())
