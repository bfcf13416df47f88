"""The response store's contract, the same for both backends (router/api/response_store/): SQLite in a
file, and PostgreSQL on a real server this module starts (tests/postgres_server.py); then two routers
sharing one PostgreSQL database. Without the server's binaries (or psycopg) the PostgreSQL cases skip,
naming what is missing."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator

import pytest

from router.api.model import ServedModel
from router.api.response_store import ResponseStore, SqliteResponseStore, StoredResponse, open_store, owner_of
from router.api.response_store.base import KeptCaller, LeaseLost
from router.api.response_store.sqlite import SCHEMA
from router.settings import ResponseStoreSettings
from tests.postgres_server import PostgresServer, missing
from tests.router.api.test_responses import ids, router, sdk
from tests.support.fakes import FakeWorkerClient

PASSWORD = "not-a-real-password-7f3a"  # in the URLs: trust auth ignores it, and no message may show it
OWNER = owner_of("key-a")

Opener = Callable[..., ResponseStore]


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    pytest.importorskip("psycopg", reason="psycopg not installed (pip install 'pdserve[postgres]')")
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a new, empty database on the module's server (with a password in it)."""
    name = postgres_server.create_database()
    yield postgres_server.url(name, password=PASSWORD)
    postgres_server.drop_database(name)


@pytest.fixture(params=["sqlite", "postgres"])
def open_on_one_database(request, tmp_path) -> Iterator[Opener]:
    """Opens a store (through ``open_store``) on one database; each call another store object on it."""
    if request.param == "sqlite":
        where = {"path": str(tmp_path / "responses.sqlite")}
    else:
        where = {"url": request.getfixturevalue("postgres_url")}
    opened: list[ResponseStore] = []

    def open_one(**limits) -> ResponseStore:
        store = open_store(ResponseStoreSettings(**where, **limits))
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


def stored(rid: str, owner: str = OWNER, created_at: float | None = None, text: str = "Paris.") -> StoredResponse:
    return StoredResponse(
        id=rid,
        owner=owner,
        created_at=time.time() if created_at is None else created_at,
        response={"id": rid, "object": "response", "output": [{"type": "message", "content": text}]},
        input_items=[{"id": f"msg_{rid}", "type": "message", "role": "user", "content": "Capital of France?"}],
        conversation=[{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": text}],
        decode_worker="d0",
    )


def test_put_get_replace_and_delete(open_on_one_database):
    store = open_on_one_database()
    r = stored("resp_1")
    store.put(r)
    assert store.get("resp_1", OWNER) == r and store.count() == 1
    assert store.get("resp_nope", OWNER) is None
    newer = stored("resp_1", text="Paris, France.")
    store.put(newer)  # the same id again: the row is replaced
    assert store.get("resp_1", OWNER) == newer and store.count() == 1
    assert store.delete("resp_1", OWNER) is True
    assert store.get("resp_1", OWNER) is None and store.count() == 0
    assert store.delete("resp_1", OWNER) is False


def test_another_owner_finds_nothing_and_deletes_nothing(open_on_one_database):
    store = open_on_one_database()
    store.put(stored("resp_a"))
    other = owner_of("key-b")
    assert store.get("resp_a", other) is None and store.get("resp_a", "") is None
    assert store.delete("resp_a", other) is False
    assert store.get("resp_a", OWNER) is not None


def test_expired_responses_are_not_found_and_are_pruned(open_on_one_database):
    store = open_on_one_database(ttl_s=60.0)
    store.put(stored("resp_fresh"))  # a store's first write prunes: nothing has expired yet
    assert store.count() == 1
    later = open_on_one_database(ttl_s=60.0)
    later.put(stored("resp_old", created_at=time.time() - 120))  # written expired: pruned at once
    assert later.get("resp_old", OWNER) is None and later.count() == 1
    later.put(stored("resp_half", created_at=time.time() - 30))
    assert later.get("resp_half", OWNER) is not None and later.get("resp_fresh", OWNER) is not None
    # A store with a shorter ttl no longer finds what a longer one still does.
    short = open_on_one_database(ttl_s=10.0)
    assert short.get("resp_half", OWNER) is None and short.get("resp_fresh", OWNER) is not None


def test_beyond_max_rows_the_oldest_go(open_on_one_database):
    now = time.time()
    first = open_on_one_database(max_rows=3)
    for i in range(5):  # pruned once, on the first write only (at most once a minute per store)
        first.put(stored(f"resp_{i}", created_at=now - 100 + i))
    assert first.count() == 5
    second = open_on_one_database(max_rows=3)
    second.put(stored("resp_5", created_at=now))
    assert second.count() == 3
    assert [i for i in range(6) if second.get(f"resp_{i}", OWNER) is not None] == [3, 4, 5]


def test_two_store_objects_on_one_database_share_it(open_on_one_database):
    a = open_on_one_database()
    a.put(stored("resp_shared"))
    b = open_on_one_database()  # another router's store, or this one's after a restart
    assert b.get("resp_shared", OWNER) == a.get("resp_shared", OWNER) is not None
    assert b.delete("resp_shared", OWNER) is True
    assert a.get("resp_shared", OWNER) is None
    a.close()
    c = open_on_one_database()
    c.put(stored("resp_after"))
    assert b.get("resp_after", OWNER) is not None


def test_unicode_and_large_json_come_back_exactly(open_on_one_database):
    store = open_on_one_database()
    text = 'héllo 世界 🙂 \u0000 nul, \ud800 lone surrogate, "quotes" and \\ backslash'
    big = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} " + "x" * 4000} for i in range(500)]
    r = StoredResponse(
        id="resp_big",
        owner=owner_of("ключ 🔑"),
        created_at=time.time(),
        response={"z": text, "a": [1, 2.5, None, True], "m": {"b": 1, "a": 2}},
        input_items=[{"content": text}],
        conversation=big,
        decode_worker=None,
    )
    store.put(r)
    got = open_on_one_database().get("resp_big", owner_of("ключ 🔑"))
    assert got == r
    assert list(got.response) == ["z", "a", "m"] and list(got.response["m"]) == ["b", "a"]  # key order kept


def test_the_default_is_sqlite_in_memory():
    store = open_store(ResponseStoreSettings())
    try:
        assert isinstance(store, SqliteResponseStore) and store.path == ":memory:"
    finally:
        store.close()


def test_a_store_is_a_sqlite_path_or_a_postgres_url_not_both():
    with pytest.raises(ValueError, match="not both"):
        ResponseStoreSettings(path="/tmp/r.sqlite", url="postgresql://u@h/db")
    assert PASSWORD not in repr(ResponseStoreSettings(url=f"postgresql://u:{PASSWORD}@h/db"))


# ---- PostgreSQL only ----------------------------------------------------------------------------------------


def test_postgres_reconnects_once_when_the_server_drops_the_connection(postgres_server, postgres_url):
    import psycopg

    store = open_store(ResponseStoreSettings(url=postgres_url))
    try:
        store.put(stored("resp_1"))
        database = postgres_url.rsplit("/", 1)[1]
        with psycopg.connect(postgres_server.url(), autocommit=True) as admin:
            (ended,) = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s", (database,)
            ).fetchone()
        assert ended == 1
        assert store.get("resp_1", OWNER) is not None  # on a new connection
        store.put(stored("resp_2"))
        assert store.count() == 2
    finally:
        store.close()


def test_postgres_errors_and_repr_name_the_server_never_the_password(postgres_url):
    from router.api.response_store.postgres import ResponseStoreUnavailable

    store = open_store(ResponseStoreSettings(url=postgres_url))
    try:
        assert PASSWORD not in repr(store) and "127.0.0.1" in repr(store)
    finally:
        store.close()
    with pytest.raises(ResponseStoreUnavailable) as refused:
        store.get("resp_1", OWNER)
    assert "closed" in str(refused.value)
    from tests.postgres_server import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(ResponseStoreUnavailable) as unreachable:
        open_store(ResponseStoreSettings(url=f"postgresql://pdserve:{PASSWORD}@127.0.0.1:{port}/db"))
    message = str(unreachable.value)
    assert f"127.0.0.1:{port}/db" in message and "cannot connect" in message
    assert PASSWORD not in message and PASSWORD not in repr(unreachable.value.__context__)


# ---- two routers, one database ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_model) -> ServedModel:
    return ServedModel.load("tiny", tiny_model)


def test_two_routers_sharing_a_postgres_database_continue_each_others_conversations(served, postgres_url):
    store = ResponseStoreSettings(url=postgres_url)
    fake_a = FakeWorkerClient(reply=ids(served, "Paris."))
    fake_b = FakeWorkerClient(reply=ids(served, "Rome."))
    with router(served, fake_a, response_store=store) as a, router(served, fake_b, response_store=store) as b:
        first = sdk(a).responses.create(model="tiny", input="Capital of France?")
        assert sdk(b).responses.retrieve(first.id).output_text == "Paris."
        second = sdk(b).responses.create(model="tiny", input="And of Italy?", previous_response_id=first.id)
        assert second.output_text == "Rome." and second.previous_response_id == first.id
        assert [i.content[0].text for i in sdk(a).responses.input_items.list(second.id).data] == ["And of Italy?"]
        assert b.delete(f"/v1/responses/{first.id}").status_code == 200
        assert a.get(f"/v1/responses/{first.id}").status_code == 404
    assert fake_a.opened and len(fake_b.opened) == 1
    assert fake_b.opened[0][1].prompt_token_ids == served.encode_chat(
        [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ]
    )


# ---- a background response's event log ----------------------------------------------------------------------


def events(n: int, start: int = 0) -> list[tuple[int, str]]:
    return [(i, f'event: response.output_text.delta\ndata: {{"sequence_number": {i}}}\n\n') for i in range(start, n)]


def test_events_come_back_after_a_sequence_number_in_order_and_a_rewrite_changes_nothing(open_on_one_database):
    store = open_on_one_database()
    store.put(stored("resp_bg"))
    assert store.append_events("resp_bg", events(3)) is False
    assert store.append_events("resp_bg", events(6, start=3)) is False
    assert store.events_after("resp_bg", -1, 100) == events(6)
    assert store.events_after("resp_bg", 2, 2) == events(5, start=3)
    assert store.events_after("resp_bg", 5, 100) == [] and store.event_count("resp_bg") == 6
    store.append_events("resp_bg", [(4, "a different text")])  # a write retried: the first stays
    assert store.events_after("resp_bg", 3, 1) == events(5, start=4)
    other = open_on_one_database()  # another router's store reads the same log
    assert other.events_after("resp_bg", -1, 100) == events(6) and other.event_count("resp_nope") == 0


def test_a_cancel_asked_on_one_store_is_seen_by_the_writer_on_another(open_on_one_database):
    writer, asker = open_on_one_database(), open_on_one_database()
    writer.put(stored("resp_bg"))
    assert writer.append_events("resp_bg", []) is False
    asker.request_cancel("resp_bg")
    asker.request_cancel("resp_bg")  # asked twice: once
    assert writer.append_events("resp_bg", events(1)) is True
    assert writer.append_events("resp_other", []) is False


def test_deleting_or_pruning_a_response_takes_its_events_and_cancel_with_it(open_on_one_database):
    store = open_on_one_database()
    store.put(stored("resp_gone"))
    store.append_events("resp_gone", events(4))
    store.request_cancel("resp_gone")
    assert store.delete("resp_gone", OWNER) is True
    assert store.event_count("resp_gone") == 0 and store.append_events("resp_gone", []) is False
    pruning = open_on_one_database(ttl_s=60.0)
    pruning.put(stored("resp_old", created_at=time.time() - 120))  # expired: pruned by this first write
    pruning.append_events("resp_old", events(2))
    pruning.request_cancel("resp_old")
    fresh = open_on_one_database(ttl_s=60.0)
    fresh.put(stored("resp_new"))  # its first write prunes: the expired row, then what hangs off no row
    assert fresh.event_count("resp_old") == 0 and fresh.append_events("resp_old", []) is False


def test_a_lease_is_renewed_by_its_holder_only_and_taken_by_one_router_once_expired(open_on_one_database):
    a, b, c = open_on_one_database(), open_on_one_database(), open_on_one_database()
    a.put(stored("resp_bg"))
    assert a.renew_lease("resp_bg", "router-a", 100.0) is True  # the first holder
    assert a.renew_lease("resp_bg", "router-a", 200.0) is True
    assert b.renew_lease("resp_bg", "router-b", 300.0) is False  # held by another
    assert b.take_lease("resp_bg", "router-b", 400.0, now=150.0) is False  # not expired yet
    assert b.take_lease("resp_bg", "router-b", 400.0, now=250.0) is True  # expired: b's now
    assert c.take_lease("resp_bg", "router-c", 400.0, now=250.0) is False  # and nobody else's
    assert a.renew_lease("resp_bg", "router-a", 500.0) is False and b.renew_lease("resp_bg", "router-b", 500.0)
    assert a.take_lease("resp_nope", "router-a", 1.0, now=2.0) is False  # no lease: nothing to take
    assert a.delete("resp_bg", OWNER) and a.renew_lease("resp_bg", "router-c", 1.0) is True  # gone with its row


def test_an_ended_lease_never_lapses_and_lapsed_ones_are_listed_latest_first(open_on_one_database):
    a, b = open_on_one_database(), open_on_one_database()
    for rid, until in (("resp_late", 120.0), ("resp_early", 110.0), ("resp_live", 900.0), ("resp_done", 100.0)):
        a.put(stored(rid))
        assert a.renew_lease(rid, "router-a", until)
    a.end_lease("resp_done")  # it ended: held by nobody, for ever
    assert b.lapsed_leases(now=500.0, limit=10) == [("resp_late", OWNER), ("resp_early", OWNER)]
    assert b.lapsed_leases(now=500.0, limit=1) == [("resp_late", OWNER)]
    assert b.take_lease("resp_done", "router-b", 600.0, now=1e9) is False
    assert a.renew_lease("resp_done", "router-a", 1e9) is False  # its last holder cannot take it back
    assert b.take_lease("resp_late", "router-b", 600.0, now=500.0) is True
    assert a.lapsed_leases(now=500.0, limit=10) == [("resp_early", OWNER)]


def test_events_fenced_by_a_lease_are_written_only_while_their_writer_holds_it(open_on_one_database):
    a, b = open_on_one_database(), open_on_one_database()
    a.put(stored("resp_bg"))
    with pytest.raises(LeaseLost):  # no lease yet: nobody's
        a.append_events("resp_bg", events(1), "router-a")
    assert a.renew_lease("resp_bg", "router-a", 100.0)
    assert a.append_events("resp_bg", events(2), "router-a") is False
    assert b.take_lease("resp_bg", "router-b", 200.0, now=150.0)  # a went silent past its lease
    with pytest.raises(LeaseLost, match="resp_bg"):  # a, back, writes nothing more
        a.append_events("resp_bg", events(4, start=2), "router-a")
    assert b.append_events("resp_bg", events(3, start=2), "router-b") is False
    assert a.events_after("resp_bg", -1, 100) == events(3)
    assert a.append_events("resp_bg", [], "router-a") is False  # only the question: not fenced


def test_a_kept_request_is_read_back_exactly_and_goes_with_its_response(open_on_one_database):
    a, b = open_on_one_database(), open_on_one_database()
    a.put(stored("resp_bg"))
    request = '{"model": "tiny", "input": "Capital of France? \\u0000 \u00e9", "background": true, "seed": 7}'
    a.keep_request("resp_bg", request)
    assert b.request_of("resp_bg") == request and b.request_of("resp_nope") is None
    assert b.caller_of("resp_bg") is None  # kept without its caller (as a router of an earlier version does)
    a.keep_request("resp_bg", "{}", KeptCaller("light", "batch"))  # kept again: replaced
    assert b.request_of("resp_bg") == "{}" and b.caller_of("resp_bg") == KeptCaller("light", "batch")
    a.keep_request("resp_bg", "{}", KeptCaller("light"))
    assert b.caller_of("resp_bg") == KeptCaller("light", None) and b.caller_of("resp_nope") is None
    a.keep_request("resp_bg", "{}")
    assert b.caller_of("resp_bg") is None
    a.keep_request("resp_bg", "{}", KeptCaller("light", "batch"))
    assert a.delete("resp_bg", OWNER) and b.request_of("resp_bg") is None and b.caller_of("resp_bg") is None


def test_a_file_an_earlier_version_made_gains_the_callers_table_and_its_kept_requests_have_none(tmp_path):
    """The schema grows by tables (CREATE TABLE IF NOT EXISTS), never by columns: a file made before
    ``response_callers`` opens, and a router of the earlier version still writes its requests in it."""
    path = tmp_path / "responses.sqlite"
    earlier = SCHEMA.split("-- Whom that request runs for")[0]
    with sqlite3.connect(path) as db:
        db.executescript(earlier)
    store = SqliteResponseStore(str(path))
    store.put(stored("resp_old"))
    with sqlite3.connect(path) as db:  # the earlier router's own write
        db.execute("INSERT OR REPLACE INTO response_requests VALUES (?, ?)", ("resp_old", "{}"))
    assert store.request_of("resp_old") == "{}" and store.caller_of("resp_old") is None
    store.keep_request("resp_new", "{}", KeptCaller("light", "batch"))
    assert store.caller_of("resp_new") == KeptCaller("light", "batch")
    store.close()


def test_two_routers_sharing_a_postgres_database_stream_and_cancel_each_others_background_responses(
    served, postgres_url
):
    store = ResponseStoreSettings(url=postgres_url)
    answer = "Paris is the capital of France, and a large city on the Seine."
    fake_a = FakeWorkerClient(reply=ids(served, answer), delay=0.5)  # still answering when b cancels it
    fake_b = FakeWorkerClient(reply=ids(served, "unused"))
    with router(served, fake_a, response_store=store) as a, router(served, fake_b, response_store=store) as b:
        made = sdk(a).responses.create(model="tiny", input="Capital of France?", background=True)
        seen = []
        with sdk(b).responses.retrieve(made.id, stream=True) as live:
            for event in live:
                seen.append(event)
                if event.type == "response.output_text.delta":
                    break
        assert sdk(b).responses.cancel(made.id).status == "cancelled"
        assert fake_a.aborts != [] and fake_b.opened == []
        events = list(sdk(a).responses.retrieve(made.id, stream=True))
    assert [e.model_dump() for e in events[: len(seen)]] == [e.model_dump() for e in seen]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert answer.startswith("".join(e.delta for e in events if e.type == "response.output_text.delta"))
