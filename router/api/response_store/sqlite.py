"""The embedded store: SQLite (the standard library's) in WAL mode, one file, or ``:memory:`` for a router
whose responses need not outlive it. Several routers on one machine (or one shared disk) may share the file.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from router.api.response_store.base import COLUMNS, PRUNE_EVERY_S, StoredResponse

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
