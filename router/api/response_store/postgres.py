"""The shared store: PostgreSQL, so that several routers share their stored responses (a conversation
started on one continues on any). psycopg 3 (the ``postgres`` extra).

The table is the SQLite store's, with ``created_at`` a DOUBLE PRECISION; the JSON columns are TEXT, as
written (JSONB would reorder an object's keys and refuse a ``\\u0000`` in a string). One connection in
autocommit mode, used one call at a time under a lock (calls are short): a connection the server dropped
(a restart, a failover, an idle timeout) is opened again once and the call retried on it. The URL may
hold a password: it is never in a repr, a log line or an error, which name only host, port and database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeAlias, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow

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

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        response TEXT NOT NULL,      -- the response object, as the API returns it
        input_items TEXT NOT NULL,   -- this turn's input items, with their ids
        conversation TEXT NOT NULL,  -- chat messages: every turn's input and output, this one's included
        decode_worker TEXT           -- the decode server that answered (a routing hint for the next turn)
    )""",
    "CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at)",
    """CREATE TABLE IF NOT EXISTS response_events (  -- a background response's events, in order
        response_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (response_id, seq)
    )""",
    "CREATE TABLE IF NOT EXISTS response_cancels (response_id TEXT PRIMARY KEY)",  # asked to stop
    """CREATE TABLE IF NOT EXISTS response_leases (  -- the router running a background response
        response_id TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS response_requests (  -- a background response's request, for a router adopting it
        response_id TEXT PRIMARY KEY,
        request TEXT NOT NULL
    )""",
    # Whom that request runs for, by configured name: a table of its own, as in the SQLite store.
    """CREATE TABLE IF NOT EXISTS response_callers (
        response_id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        priority_class TEXT
    )""",
)
EVENT_TABLES = ("response_events", "response_cancels", "response_leases", "response_requests", "response_callers")
# Routers starting together would race in CREATE TABLE IF NOT EXISTS (a duplicate-key error on the
# catalog): each holds this advisory lock while it creates the table.
SCHEMA_LOCK = 0x7064_7365_7276_6531
CONNECT_TIMEOUT_S = 10
UPSERT = (
    f"INSERT INTO responses ({COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
    "owner = EXCLUDED.owner, created_at = EXCLUDED.created_at, response = EXCLUDED.response, "
    "input_items = EXCLUDED.input_items, conversation = EXCLUDED.conversation, decode_worker = EXCLUDED.decode_worker"
)

T = TypeVar("T")
Connection: TypeAlias = psycopg.Connection[TupleRow]


class ResponseStoreUnavailable(RuntimeError):
    """The database cannot be reached; the message names host, port and database, never the URL."""


def where(url: str) -> str:
    """``host:port/database`` of a PostgreSQL URL or conninfo: what errors name instead of the URL."""
    try:
        info = conninfo_to_dict(url)
    except psycopg.Error:
        return "(a URL that does not parse)"
    return (
        f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname') or info.get('user') or ''}"
    )


class PostgresResponseStore:
    """``url``: ``postgresql://user:password@host:port/database`` (or a libpq conninfo string). The table is
    made if missing; the database must exist."""

    def __init__(self, url: str, ttl_s: float = 30 * 24 * 3600.0, max_rows: int = 100_000) -> None:
        self._url = url
        self.where = where(url)
        self.ttl_s, self.max_rows = ttl_s, max_rows
        self._lock = threading.Lock()  # one connection, used from the handlers' threads one call at a time
        self._pruned_at = 0.0
        self._closed = False
        with self._lock:
            self._conn: Connection | None = self._connect()
            with self._conn.transaction():
                self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                for statement in SCHEMA:
                    self._conn.execute(statement)

    def __repr__(self) -> str:
        return f"PostgresResponseStore({self.where!r})"

    def put(self, r: StoredResponse) -> None:
        def put(conn: Connection) -> None:
            conn.execute(UPSERT, r.row())
            if time.monotonic() - self._pruned_at >= PRUNE_EVERY_S:
                self._prune(conn)

        self._call(put)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it exists, belongs to ``owner`` and has not expired."""
        row = self._call(
            lambda conn: conn.execute(
                f"SELECT {COLUMNS} FROM responses WHERE id = %s AND owner = %s AND created_at >= %s",
                (response_id, owner, time.time() - self.ttl_s),
            ).fetchone()
        )
        return None if row is None else StoredResponse.from_row(row)

    def delete(self, response_id: str, owner: str) -> bool:
        # Retried on a new connection after a drop, a delete that went through before it reads as not found.
        def delete(conn: Connection) -> bool:
            with conn.transaction():
                cursor = conn.execute("DELETE FROM responses WHERE id = %s AND owner = %s", (response_id, owner))
                if cursor.rowcount > 0:
                    for table in EVENT_TABLES:
                        conn.execute(f"DELETE FROM {table} WHERE response_id = %s", (response_id,))
            return cursor.rowcount > 0

        return self._call(delete)

    def append_events(self, response_id: str, events: list[Event], holder: str | None = None) -> bool:
        def append(conn: Connection) -> bool:
            if events:
                with conn.transaction(), conn.cursor() as cursor:  # retried after a drop: the events already in stay
                    if holder is not None:  # the lease's row locked till COMMIT: take_lease waits for it
                        query = "SELECT holder FROM response_leases WHERE response_id = %s FOR UPDATE"
                        held = cursor.execute(query, (response_id,)).fetchone()
                        if held is None or held[0] != holder:
                            raise LeaseLost(f"background response {response_id}: its lease is not {holder}'s")
                    cursor.executemany(
                        "INSERT INTO response_events VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                        [(response_id, seq, data) for seq, data in events],
                    )
            asked = conn.execute("SELECT 1 FROM response_cancels WHERE response_id = %s", (response_id,))
            return asked.fetchone() is not None

        return self._call(append)

    def events_after(self, response_id: str, after: int, limit: int) -> list[Event]:
        rows = self._call(
            lambda conn: conn.execute(
                "SELECT seq, data FROM response_events WHERE response_id = %s AND seq > %s ORDER BY seq LIMIT %s",
                (response_id, after, limit),
            ).fetchall()
        )
        return [(int(seq), data) for seq, data in rows]

    def event_count(self, response_id: str) -> int:
        row = self._call(
            lambda conn: conn.execute(
                "SELECT COUNT(*) FROM response_events WHERE response_id = %s", (response_id,)
            ).fetchone()
        )
        return 0 if row is None else int(row[0])

    def request_cancel(self, response_id: str) -> None:
        self._call(
            lambda conn: conn.execute("INSERT INTO response_cancels VALUES (%s) ON CONFLICT DO NOTHING", (response_id,))
        )

    def keep_request(self, response_id: str, request: str, caller: KeptCaller | None = None) -> None:
        def keep(conn: Connection) -> None:
            with conn.transaction():
                conn.execute(
                    "INSERT INTO response_requests VALUES (%s, %s) ON CONFLICT (response_id) DO UPDATE "
                    "SET request = EXCLUDED.request",
                    (response_id, request),
                )
                conn.execute("DELETE FROM response_callers WHERE response_id = %s", (response_id,))
                if caller is not None:
                    conn.execute(
                        "INSERT INTO response_callers VALUES (%s, %s, %s)",
                        (response_id, caller.tenant, caller.priority_class),
                    )

        self._call(keep)

    def request_of(self, response_id: str) -> str | None:
        row = self._call(
            lambda conn: conn.execute(
                "SELECT request FROM response_requests WHERE response_id = %s", (response_id,)
            ).fetchone()
        )
        return None if row is None else str(row[0])

    def caller_of(self, response_id: str) -> KeptCaller | None:
        row = self._call(
            lambda conn: conn.execute(
                "SELECT tenant, priority_class FROM response_callers WHERE response_id = %s", (response_id,)
            ).fetchone()
        )
        return None if row is None else KeptCaller(str(row[0]), None if row[1] is None else str(row[1]))

    def renew_lease(self, response_id: str, holder: str, until: float) -> bool:
        cursor = self._call(
            lambda conn: conn.execute(
                "INSERT INTO response_leases VALUES (%s, %s, %s) ON CONFLICT (response_id) DO UPDATE "
                "SET expires_at = EXCLUDED.expires_at WHERE response_leases.holder = EXCLUDED.holder",
                (response_id, holder, until),
            )
        )
        return cursor.rowcount > 0

    def take_lease(self, response_id: str, holder: str, until: float, now: float) -> bool:
        cursor = self._call(
            lambda conn: conn.execute(
                "UPDATE response_leases SET holder = %s, expires_at = %s WHERE response_id = %s AND expires_at < %s",
                (holder, until, response_id, now),
            )
        )
        return cursor.rowcount > 0

    def end_lease(self, response_id: str) -> None:
        self._call(
            lambda conn: conn.execute(
                "UPDATE response_leases SET holder = %s, expires_at = %s WHERE response_id = %s",
                (ENDED_HOLDER, ENDED_UNTIL, response_id),
            )
        )

    def lapsed_leases(self, now: float, limit: int) -> list[tuple[str, str]]:
        rows = self._call(
            lambda conn: conn.execute(
                "SELECT l.response_id, r.owner FROM response_leases l JOIN responses r ON r.id = l.response_id "
                "WHERE l.expires_at < %s ORDER BY l.expires_at DESC LIMIT %s",
                (now, limit),
            ).fetchall()
        )
        return [(str(rid), str(owner)) for rid, owner in rows]

    def count(self) -> int:
        row = self._call(lambda conn: conn.execute("SELECT COUNT(*) FROM responses").fetchone())
        return 0 if row is None else int(row[0])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _connect(self) -> Connection:
        try:
            return psycopg.connect(self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        except psycopg.Error as exc:
            # libpq's message names host, port and user, never the password; the URL itself stays out.
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise ResponseStoreUnavailable(f"response store {self.where}: cannot connect: {reason}") from None

    def _call(self, work: Callable[[Connection], T]) -> T:
        """``work`` on the connection; once more on a new one if the server dropped it."""
        with self._lock:
            if self._closed:
                raise ResponseStoreUnavailable(f"response store {self.where}: closed")
            for attempt in (1, 2):
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                conn = self._conn
                try:
                    return work(conn)
                except psycopg.OperationalError:
                    if attempt == 2 or not (conn.broken or conn.closed):
                        raise
                    conn.close()
                    self._conn = None
            raise AssertionError("unreachable")

    def _prune(self, conn: Connection) -> None:
        """Expired rows, then the oldest beyond ``max_rows`` (the caller holds the lock)."""
        self._pruned_at = time.monotonic()
        conn.execute("DELETE FROM responses WHERE created_at < %s", (time.time() - self.ttl_s,))
        conn.execute(
            "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC OFFSET %s)",
            (self.max_rows,),
        )
        for table in EVENT_TABLES:
            conn.execute(f"DELETE FROM {table} WHERE response_id NOT IN (SELECT id FROM responses)")
