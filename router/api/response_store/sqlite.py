"""The embedded store: SQLite (the standard library's) in WAL mode, one file, or ``:memory:`` for a router
whose responses need not outlive it. Several routers on one machine (or one shared disk) may share the file.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from router.api.response_store.base import (
    COLUMNS,
    ENDED_HOLDER,
    ENDED_UNTIL,
    PRUNE_EVERY_S,
    Event,
    KeptCaller,
    LeaseLost,
    StoredResponse,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,      -- the response object, as the API returns it
    input_items TEXT NOT NULL,   -- this turn's input items, with their ids
    conversation TEXT NOT NULL,  -- chat messages: every turn's input and output, this one's included
    decode_worker TEXT           -- the decode server that answered (a routing hint for the next turn)
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
CREATE TABLE IF NOT EXISTS response_events (  -- a background response's events, in order
    response_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (response_id, seq)
);
CREATE TABLE IF NOT EXISTS response_cancels (  -- background responses a client asked to stop
    response_id TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS response_leases (  -- the router running a background response, while it renews
    response_id TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS response_requests (  -- a background response's request, for a router adopting it
    response_id TEXT PRIMARY KEY,
    request TEXT NOT NULL
);
-- Whom that request runs for, by configured name. A table of its own, not columns of response_requests:
-- a router of an earlier version sharing the file still writes its two-value rows there.
CREATE TABLE IF NOT EXISTS response_callers (
    response_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    priority_class TEXT
);
"""
EVENT_TABLES = ("response_events", "response_cancels", "response_leases", "response_requests", "response_callers")


class SqliteResponseStore:
    """``path``: the SQLite file (made if missing), or ``:memory:``."""

    def __init__(self, path: str = ":memory:", ttl_s: float = 30 * 24 * 3600.0, max_rows: int = 100_000) -> None:
        if path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            path = str(Path(path).expanduser())
        self.path, self.ttl_s, self.max_rows = path, ttl_s, max_rows
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()  # one connection, used from the handlers' threads one call at a time
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
        self._pruned_at = 0.0

    def put(self, r: StoredResponse) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)", r.row())
            if time.monotonic() - self._pruned_at >= PRUNE_EVERY_S:
                self._prune()

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it exists, belongs to ``owner`` and has not expired."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {COLUMNS} FROM responses WHERE id = ? AND owner = ? AND created_at >= ?",
                (response_id, owner, time.time() - self.ttl_s),
            ).fetchone()
        return None if row is None else StoredResponse.from_row(row)

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
            if cursor.rowcount > 0:
                self._forget(response_id)
        return cursor.rowcount > 0

    def append_events(self, response_id: str, events: list[Event], holder: str | None = None) -> bool:
        with self._lock:
            if events:
                self._db.execute("BEGIN IMMEDIATE")  # the write lock first: the lease read stays true till COMMIT
                try:  # an event already there (a write retried) stays as it was
                    if holder is not None:
                        query = "SELECT holder FROM response_leases WHERE response_id = ?"
                        held = self._db.execute(query, (response_id,)).fetchone()
                        if held is None or held[0] != holder:
                            raise LeaseLost(f"background response {response_id}: its lease is not {holder}'s")
                    self._db.executemany(
                        "INSERT OR IGNORE INTO response_events VALUES (?, ?, ?)",
                        [(response_id, seq, data) for seq, data in events],
                    )
                except (sqlite3.Error, LeaseLost):
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            asked = "SELECT 1 FROM response_cancels WHERE response_id = ?"
            return self._db.execute(asked, (response_id,)).fetchone() is not None

    def events_after(self, response_id: str, after: int, limit: int) -> list[Event]:
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, data FROM response_events WHERE response_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (response_id, after, limit),
            ).fetchall()
        return [(int(seq), data) for seq, data in rows]

    def event_count(self, response_id: str) -> int:
        with self._lock:
            query = "SELECT COUNT(*) FROM response_events WHERE response_id = ?"
            return int(self._db.execute(query, (response_id,)).fetchone()[0])

    def request_cancel(self, response_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO response_cancels VALUES (?)", (response_id,))

    def keep_request(self, response_id: str, request: str, caller: KeptCaller | None = None) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO response_requests VALUES (?, ?)", (response_id, request))
                self._db.execute("DELETE FROM response_callers WHERE response_id = ?", (response_id,))
                if caller is not None:
                    self._db.execute(
                        "INSERT INTO response_callers VALUES (?, ?, ?)",
                        (response_id, caller.tenant, caller.priority_class),
                    )
            except sqlite3.Error:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def request_of(self, response_id: str) -> str | None:
        with self._lock:
            query = "SELECT request FROM response_requests WHERE response_id = ?"
            row = self._db.execute(query, (response_id,)).fetchone()
        return None if row is None else str(row[0])

    def caller_of(self, response_id: str) -> KeptCaller | None:
        with self._lock:
            query = "SELECT tenant, priority_class FROM response_callers WHERE response_id = ?"
            row = self._db.execute(query, (response_id,)).fetchone()
        return None if row is None else KeptCaller(str(row[0]), None if row[1] is None else str(row[1]))

    def renew_lease(self, response_id: str, holder: str, until: float) -> bool:
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO response_leases VALUES (?, ?, ?) ON CONFLICT (response_id) DO UPDATE "
                "SET expires_at = excluded.expires_at WHERE response_leases.holder = excluded.holder",
                (response_id, holder, until),
            )
        return cursor.rowcount > 0

    def take_lease(self, response_id: str, holder: str, until: float, now: float) -> bool:
        with self._lock:
            cursor = self._db.execute(
                "UPDATE response_leases SET holder = ?, expires_at = ? WHERE response_id = ? AND expires_at < ?",
                (holder, until, response_id, now),
            )
        return cursor.rowcount > 0

    def end_lease(self, response_id: str) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE response_leases SET holder = ?, expires_at = ? WHERE response_id = ?",
                (ENDED_HOLDER, ENDED_UNTIL, response_id),
            )

    def lapsed_leases(self, now: float, limit: int) -> list[tuple[str, str]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT l.response_id, r.owner FROM response_leases l JOIN responses r ON r.id = l.response_id "
                "WHERE l.expires_at < ? ORDER BY l.expires_at DESC LIMIT ?",
                (now, limit),
            ).fetchall()
        return [(str(rid), str(owner)) for rid, owner in rows]

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _prune(self) -> None:
        """Expired rows, then the oldest beyond ``max_rows`` (the caller holds the lock)."""
        self._pruned_at = time.monotonic()
        self._db.execute("DELETE FROM responses WHERE created_at < ?", (time.time() - self.ttl_s,))
        self._db.execute(
            "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC LIMIT -1 OFFSET ?)",
            (self.max_rows,),
        )
        for table in EVENT_TABLES:
            self._db.execute(f"DELETE FROM {table} WHERE response_id NOT IN (SELECT id FROM responses)")

    def _forget(self, response_id: str) -> None:
        """A deleted response's events and cancel request (the caller holds the lock)."""
        for table in EVENT_TABLES:
            self._db.execute(f"DELETE FROM {table} WHERE response_id = ?", (response_id,))
