"""Where stored responses live (``store: true`` on ``/v1/responses``): one small interface, a database behind it.

A stored response keeps what the API returns for it (the response object and its input items) and
what a continuation needs: the conversation so far as chat messages (every earlier turn's input and
output, this turn's too), so that ``previous_response_id`` costs one lookup however long the chain,
and the decode server that answered it, a hint for sending the next turn where the conversation's KV
is cached. Each row has an owner (a hash of the API key that made it, "" without keys): another key's
lookup finds nothing, exactly as an id that never existed.

Two backends behind ``ResponseStore`` (base.py), picked by ``open_store`` from the router's settings
(``router.response_store`` in the cluster YAML):

- SQLite (sqlite.py, the default): embedded, WAL mode, one file (`pdserve launch`'s run folder) or
  ``:memory:`` for a router whose responses need not outlive it.
- PostgreSQL (postgres.py, ``url``): for several routers sharing state; psycopg, the ``postgres``
  extra, imported only when a URL is set.

Either keeps rows ``ttl_s`` and at most ``max_rows`` (the oldest go), pruned at most once a minute on a
write. A background response's events (router/api/background.py) are a log beside its row, and a cancel
asked for it a row of its own: both go with the response's row. Calls block (milliseconds): the handlers
make them off the event loop.
"""

from __future__ import annotations

from router.api.response_store.base import ResponseStore, StoredResponse, owner_of
from router.api.response_store.sqlite import SqliteResponseStore
from router.settings import ResponseStoreSettings

__all__ = ["ResponseStore", "SqliteResponseStore", "StoredResponse", "open_store", "owner_of"]


def open_store(settings: ResponseStoreSettings) -> ResponseStore:
    """PostgreSQL when ``settings.url`` is set, else SQLite at ``settings.path``."""
    if settings.url is None:
        return SqliteResponseStore(settings.path, settings.ttl_s, settings.max_rows)
    try:
        from router.api.response_store.postgres import PostgresResponseStore
    except ImportError as exc:
        raise RuntimeError(
            f"router.response_store.url needs psycopg ({exc}): pip install 'pdserve[postgres]'"
        ) from None
    return PostgresResponseStore(settings.url, settings.ttl_s, settings.max_rows)
