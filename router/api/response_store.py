"""Where stored responses live (``store: true`` on ``/v1/responses``): one small interface, SQLite behind it.

A stored response keeps what the API returns for it (the response object and its input items) and
what a continuation needs: the conversation so far as chat messages (every earlier turn's input and
output, this turn's too), so that ``previous_response_id`` costs one lookup however long the chain,
and the decode server that answered it, a hint for sending the next turn where the conversation's KV
is cached. Each row has an owner (a hash of the API key that made it, "" without keys): another key's
lookup finds nothing, exactly as an id that never existed.

SQLite (the standard library's) in WAL mode: one file, or ``:memory:`` for a router whose responses
need not outlive it. Rows older than ``ttl_s`` are deleted, and beyond ``max_rows`` the oldest go,
at most once a minute on a write. Calls block (milliseconds): the handlers make them off the event
loop.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRUNE_EVERY_S = 60.0

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
"""


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


class ResponseStore:
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
        row = (
            r.id,
            r.owner,
            r.created_at,
            json.dumps(r.response),
            json.dumps(r.input_items),
            json.dumps(r.conversation),
            r.decode_worker,
        )
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)", row)
            if time.monotonic() - self._pruned_at >= PRUNE_EVERY_S:
                self._prune()

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it exists, belongs to ``owner`` and has not expired."""
        with self._lock:
            row = self._db.execute(
                "SELECT id, owner, created_at, response, input_items, conversation, decode_worker FROM responses "
                "WHERE id = ? AND owner = ? AND created_at >= ?",
                (response_id, owner, time.time() - self.ttl_s),
            ).fetchone()
        if row is None:
            return None
        rid, own, created, response, items, conversation, worker = row
        return StoredResponse(
            rid, own, created, json.loads(response), json.loads(items), json.loads(conversation), worker
        )

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cursor.rowcount > 0

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
