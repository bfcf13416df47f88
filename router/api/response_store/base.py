"""What every response store shares: the stored row, its owner, the interface, the JSON encoding."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol

PRUNE_EVERY_S = 60.0  # a store deletes expired and surplus rows at most this often, on a write

# The columns, in the order both backends store and read them.
COLUMNS = "id, owner, created_at, response, input_items, conversation, decode_worker"

Row = tuple[str, str, float, str, str, str, str | None]
ENDED_HOLDER, ENDED_UNTIL = "ended", 1e18  # the lease of a response that ended: held by nobody, for ever
Event = tuple[int, str]  # a background response's event: its sequence number and its text (one SSE event)


@dataclass(frozen=True)
class KeptCaller:
    """Whom a background response runs for: its tenant's and priority class's configured names."""

    tenant: str
    priority_class: str | None = None


class LeaseLost(RuntimeError):
    """A write fenced by a lease its writer no longer holds (another router took it)."""


def owner_of(api_key: str | None) -> str:
    """The owner a request's key stands for: a hash, so the store never holds a key."""
    return "" if not api_key else hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str
    created_at: float
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    decode_worker: str | None = None

    def row(self) -> Row:
        """The row both backends store: the JSON columns as text, exactly as written (key order kept, and
        ASCII, so a NUL or a lone surrogate in a string is an escape, never a byte a database refuses)."""
        return (
            self.id,
            self.owner,
            self.created_at,
            json.dumps(self.response),
            json.dumps(self.input_items),
            json.dumps(self.conversation),
            self.decode_worker,
        )

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> StoredResponse:
        rid, owner, created, response, items, conversation, worker = row
        return cls(rid, owner, created, json.loads(response), json.loads(items), json.loads(conversation), worker)


class ResponseStore(Protocol):
    """Where stored responses live. Every call blocks (milliseconds) and may come from any thread: the
    handlers make them off the event loop (``asyncio.to_thread``)."""

    def put(self, r: StoredResponse) -> None:
        """Keep ``r`` (replacing a row with its id)."""
        ...

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it exists, belongs to ``owner`` and has not expired."""
        ...

    def delete(self, response_id: str, owner: str) -> bool:
        """Whether ``owner`` had such a response (now gone)."""
        ...

    def count(self) -> int:
        """Rows held, expired ones not yet pruned included."""
        ...

    # A background response's event log: its events numbered 0, 1, ... in order, kept beside its row
    # (and deleted, pruned, with it), so that any router sharing the store can stream them. The row's
    # owner guards them: callers read the row (``get``) before its events.

    def append_events(self, response_id: str, events: list[Event], holder: str | None = None) -> bool:
        """Adds ``events`` (none: only the question) to the log; whether a cancel was asked for it.
        ``holder``: only while it holds the response's lease, checked in the same transaction (else
        ``LeaseLost``, nothing written): a router that lost the lease never writes after the one that took it."""
        ...

    def events_after(self, response_id: str, after: int, limit: int) -> list[Event]:
        """At most ``limit`` events numbered above ``after``, in order."""
        ...

    def event_count(self, response_id: str) -> int:
        """Events in the log (numbered 0 to this less one)."""
        ...

    def request_cancel(self, response_id: str) -> None:
        """Asks whichever router runs the response to stop it (it learns so on its next ``append_events``)."""
        ...

    # What a background response was asked, kept so that another router can carry it on (its request
    # body as JSON, the API's own schema), and for whom (its caller's tenant and priority class, by
    # configured name, never the key): written once, when it starts, and gone with its row.

    def keep_request(self, response_id: str, request: str, caller: KeptCaller | None = None) -> None:
        """Keeps the response's request and its ``caller`` (replacing those kept before; None: none kept)."""
        ...

    def request_of(self, response_id: str) -> str | None:
        """The response's kept request, if any."""
        ...

    def caller_of(self, response_id: str) -> KeptCaller | None:
        """The caller kept with the response's request, if any (none for one kept by an older router)."""
        ...

    # Who runs a background response: a lease its router renews while it runs. A lease that has expired
    # is a router gone; ``take_lease`` lets exactly one other router take it over (to carry it on, or
    # end it).

    def renew_lease(self, response_id: str, holder: str, until: float) -> bool:
        """Holds the response's lease until ``until`` (time.time()); False if another holder has it."""
        ...

    def take_lease(self, response_id: str, holder: str, until: float, now: float) -> bool:
        """Takes the response's lease if it expired before ``now``; True for exactly one caller."""
        ...

    def end_lease(self, response_id: str) -> None:
        """The response ended: its lease never expires again, so no router takes it and its last holder
        cannot renew it (a router that stalled past its lease must never write again)."""
        ...

    def lapsed_leases(self, now: float, limit: int) -> list[tuple[str, str]]:
        """At most ``limit`` responses whose lease expired before ``now`` (id, owner): their router is gone.
        The latest to expire first: a router that just died comes before leases left by older versions."""
        ...

    def close(self) -> None: ...
