"""A background response whose router died is adopted by another router sharing the store
(router/api/background.py): the other router takes the expired lease, runs the kept request again and
passes on only what the log does not have, so the resumed stream has every event once, in order, with the
text of an uninterrupted run. The dead router is the store it left: a response run to its end on router A,
then its log cut back to event K, its row back to ``in_progress`` and its lease expired, exactly what A
killed after writing event K leaves (tests/cluster/test_background_responses_cluster.py kills real ones)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import openai
import pytest

from router.api.background import Diverged, Replay
from router.api.model import ServedModel
from router.api.response_store import SqliteResponseStore, StoredResponse, owner_of
from router.api.response_store.base import COLUMNS, KeptCaller
from router.cluster.tenancy import Ticket
from router.settings import ResponseStoreSettings, TenantSettings
from tests.router.api.test_responses import ids, router, sdk
from tests.support.fakes import FakeWorkerClient
from tests.waiting import wait_until

ANSWER = "Paris is the capital of France, and a large city on the Seine."


@pytest.fixture(scope="module")
def served(tiny_model) -> ServedModel:
    return ServedModel.load("tiny", tiny_model)


def test_replay_gives_the_logged_pieces_first_then_the_text_as_it_comes():
    replay = Replay(["Par", "is", " is", ""])
    assert replay.feed("P") == []
    assert replay.feed("ari") == ["Par"]  # "i" held: the start of the next logged piece
    assert replay.feed("s is the") == ["is", " is", " the"]
    assert replay.feed(" capital") == [" capital"]
    replay.end()


def test_replay_refuses_a_text_that_leaves_the_logged_one():
    with pytest.raises(Diverged, match="'Pr' where the log has 'Par'"):
        Replay(["Par"]).feed("Pr")
    with pytest.raises(Diverged, match="'Rom' where the log has 'Par'"):
        Replay(["Par", "is"]).feed("Rome")
    short = Replay(["Par", "is"])
    short.feed("Pa")
    with pytest.raises(Diverged, match="3 characters short"):
        short.end()


def events_of(client: openai.OpenAI, response_id: str, after: int | None = None) -> list:
    if after is None:
        return list(client.responses.retrieve(response_id, stream=True))
    return list(client.responses.retrieve(response_id, stream=True, starting_after=after))


def rewind(path: Path, response_id: str, last: int, holder: str) -> None:
    """The store as the router ``holder`` leaves it killed just after writing event ``last``: the later
    events gone, the row ``in_progress`` as it was while running, the lease still ``holder``'s, expired."""
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM response_events WHERE response_id = ? AND seq > ?", (response_id, last))
        row = db.execute(f"SELECT {COLUMNS} FROM responses WHERE id = ?", (response_id,)).fetchone()
        done = StoredResponse.from_row(row)
        running = {**done.response, "status": "in_progress", "output": [], "usage": None, "completed_at": None}
        conversation = done.conversation[:-1]  # the answer's assistant message goes
        db.execute(
            "UPDATE responses SET response = ?, conversation = ? WHERE id = ?",
            (json.dumps(running), json.dumps(conversation), response_id),
        )
        expired = (holder, time.time() - 1, response_id)  # as the holder last renewed it, ended since
        db.execute("UPDATE response_leases SET holder = ?, expires_at = ? WHERE response_id = ?", expired)


@pytest.mark.parametrize("seam", ["created", "first delta", "a middle delta", "last delta", "item done"])
def test_a_response_whose_router_died_is_carried_on_by_another_every_event_once(served, tmp_path, seam):
    path = tmp_path / "responses.sqlite"
    fake_a = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake_a, response_store=ResponseStoreSettings(path=str(path))) as a:
        made = sdk(a).responses.create(
            model="tiny", input="Capital of France?", instructions="Be brief.", background=True
        )
        wait_until(lambda: sdk(a).responses.retrieve(made.id).status == "completed", what="it completed on A")
        whole = events_of(sdk(a), made.id)
        holder = a.app.state.responses.runs.holder
    deltas = [e.sequence_number for e in whole if e.type == "response.output_text.delta"]
    last = {
        "created": 0,
        "first delta": deltas[0],
        "a middle delta": deltas[len(deltas) // 2],
        "last delta": deltas[-1],
        "item done": whole[-2].sequence_number,
    }[seam]
    rewind(path, made.id, last, holder)

    fake_b = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake_b, response_store=ResponseStoreSettings(path=str(path))) as b:
        before = whole[: last + 1]  # what the client read from A before it died
        rest = events_of(sdk(b), made.id, last)  # waits for the lease to lapse, adopts, streams on
        done = sdk(b).responses.retrieve(made.id)
        # The stream and the row end before the run is forgotten (its writer returns, then it is dropped).
        wait_until(lambda: b.app.state.responses.runs.runs == {}, what="B dropped the run it carried to its end")
        assert b.app.state.responses.runs.adopted == 1
        assert "pdserve_router_background_adoptions_total 1.0" in b.get("/metrics").text.splitlines()
        again = events_of(sdk(b), made.id)
    both = before + rest
    assert [e.sequence_number for e in both] == list(range(len(whole)))
    assert [e.type for e in both] == [e.type for e in whole]
    assert [e.model_dump() for e in again[:-1]] == [e.model_dump() for e in both[:-1]]
    assert "".join(e.delta for e in both if e.type == "response.output_text.delta") == ANSWER
    assert done.status == "completed" and done.output_text == ANSWER and rest[-1].response.output_text == ANSWER
    assert done.output[0].id == whole[-1].response.output[0].id  # the same item ids: the same request id
    # B ran A's request again, from the prompt: the same prompt, the same seed (one A's router drew).
    ((_, sent_a),) = fake_a.opened
    ((_, sent_b),) = fake_b.opened
    assert sent_b.prompt_token_ids == sent_a.prompt_token_ids and sent_b.generated_token_ids == []
    assert sent_b.sampling == sent_a.sampling and sent_a.sampling.seed is not None
    assert all(s.closed for s in fake_b.streams)


def test_a_poll_adopts_it_too_and_a_different_text_ends_it_failed_where_it_diverged(served, tmp_path):
    path = tmp_path / "responses.sqlite"
    with router(
        served, FakeWorkerClient(reply=ids(served, ANSWER)), response_store=ResponseStoreSettings(path=str(path))
    ) as a:
        made = sdk(a).responses.create(model="tiny", input="Capital of France?", background=True, temperature=0)
        wait_until(lambda: sdk(a).responses.retrieve(made.id).status == "completed", what="it completed on A")
        whole = events_of(sdk(a), made.id)
        holder = a.app.state.responses.runs.holder
    last = [e.sequence_number for e in whole if e.type == "response.output_text.delta"][3]
    rewind(path, made.id, last, holder)
    fake_b = FakeWorkerClient(reply=ids(served, "Rome is the capital of Italy."))  # not what A's run gave
    with router(served, fake_b, response_store=ResponseStoreSettings(path=str(path))) as b:
        sdk(b).responses.retrieve(made.id)
        assert b.app.state.responses.runs.adopted == 1  # the poll adopted it
        wait_until(lambda: sdk(b).responses.retrieve(made.id).status == "failed", what="it ended failed")
        failed = sdk(b).responses.retrieve(made.id)
        events = events_of(sdk(b), made.id)
    assert "diverged from its logged text" in failed.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.model_dump() for e in events[: last + 1]] == [e.model_dump() for e in whole[: last + 1]]
    assert events[-1].type == "response.failed" and fake_b.aborts != []
    logged = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert ANSWER.startswith(logged) and failed.output[0].content[0].text == logged


def test_the_sweep_adopts_a_response_nobody_reads_and_forgets_an_ended_one(served, tmp_path):
    """What each router's sweep does every SWEEP_S (called here once, directly: a unit test's router runs
    no background task): a lapsed lease of a running response is adopted and runs to its end unread; one
    whose response ended is closed for good; a second sweep finds nothing."""
    path = tmp_path / "responses.sqlite"
    with router(
        served, FakeWorkerClient(reply=ids(served, ANSWER)), response_store=ResponseStoreSettings(path=str(path))
    ) as a:
        made = sdk(a).responses.create(model="tiny", input="Capital of France?", background=True)
        wait_until(lambda: sdk(a).responses.retrieve(made.id).status == "completed", what="it completed on A")
        whole = events_of(sdk(a), made.id)
        holder = a.app.state.responses.runs.holder
        store = a.app.state.responses.store
        assert store.lapsed_leases(time.time() + 3600, 10) == []  # an ended response's lease never lapses
        assert store.renew_lease(made.id, holder, time.time() + 60) is False  # nor is it renewed
    last = [e.sequence_number for e in whole if e.type == "response.output_text.delta"][1]
    rewind(path, made.id, last, holder)
    fake_b = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake_b, response_store=ResponseStoreSettings(path=str(path))) as b:
        runs = b.app.state.responses.runs
        assert b.portal.call(runs.sweep_once) == 1
        wait_until(lambda: runs.runs == {}, what="the adopted response ran to its end")
        assert b.portal.call(runs.sweep_once) == 0 and runs.store.lapsed_leases(time.time() + 3600, 10) == []
        done = sdk(b).responses.retrieve(made.id)
        events = events_of(sdk(b), made.id)
    assert done.status == "completed" and done.output_text == ANSWER and len(fake_b.opened) == 1
    assert [e.sequence_number for e in events] == list(range(len(whole)))
    assert [e.model_dump() for e in events[: last + 1]] == [e.model_dump() for e in whole[: last + 1]]


def test_a_router_whose_lease_was_taken_stops_and_writes_nothing_more(served, tmp_path):
    """A router silent past its lease (not dead: stalled) finds it taken at its next write: its events are
    fenced by the lease, so it writes nothing after the router that took it, and stops its generation."""
    path = tmp_path / "responses.sqlite"
    fake = FakeWorkerClient(reply=ids(served, ANSWER), delay=0.5)
    with router(served, fake, response_store=ResponseStoreSettings(path=str(path))) as a:
        store = a.app.state.responses.store
        made = sdk(a).responses.create(model="tiny", input="Capital of France?", background=True)
        wait_until(lambda: store.event_count(made.id) >= 5, what="the first text delta stored")
        with sqlite3.connect(path) as db:  # what another router's take_lease leaves
            db.execute("UPDATE response_leases SET holder = 'router-b' WHERE response_id = ?", (made.id,))
        wait_until(lambda: a.app.state.responses.runs.runs == {}, what="router A stopped it")
        written = store.event_count(made.id)
        assert fake.aborts != [] and all(s.closed for s in fake.streams)
    left = SqliteResponseStore(str(path))
    try:  # nothing more at A's shutdown either: no closing event, no ending row; B's to go on
        assert left.event_count(made.id) == written
        assert left.get(made.id, owner_of(None)).response["status"] == "in_progress"
    finally:
        left.close()


def test_an_adopted_turn_of_a_conversation_runs_again_with_its_history(served, tmp_path):
    path = tmp_path / "responses.sqlite"
    fake_a = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake_a, response_store=ResponseStoreSettings(path=str(path))) as a:
        first = sdk(a).responses.create(model="tiny", input="Capital of France?", instructions="Be brief.")
        made = sdk(a).responses.create(
            model="tiny", input="And its river?", previous_response_id=first.id, background=True, temperature=0
        )
        wait_until(lambda: sdk(a).responses.retrieve(made.id).status == "completed", what="it completed on A")
        whole = events_of(sdk(a), made.id)
        holder = a.app.state.responses.runs.holder
    last = [e.sequence_number for e in whole if e.type == "response.output_text.delta"][2]
    rewind(path, made.id, last, holder)
    fake_b = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake_b, response_store=ResponseStoreSettings(path=str(path))) as b:
        rest = events_of(sdk(b), made.id, last)
        done = sdk(b).responses.retrieve(made.id)
        third = sdk(b).responses.create(model="tiny", input="Thanks.", previous_response_id=made.id)
    assert [e.sequence_number for e in whole[: last + 1] + rest] == list(range(len(whole)))
    assert done.status == "completed" and done.output_text == ANSWER and done.previous_response_id == first.id
    assert fake_b.opened[0][1].prompt_token_ids == fake_a.opened[1][1].prompt_token_ids  # the same history
    assert fake_b.opened[1][1].prompt_token_ids == served.encode_chat(
        [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "And its river?"},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "Thanks."},
        ]
    )
    assert third.output_text == ANSWER


def test_a_router_killed_between_its_closing_event_and_its_row_leaves_the_row_to_write(served, tmp_path):
    path = tmp_path / "responses.sqlite"
    with router(
        served, FakeWorkerClient(reply=ids(served, ANSWER)), response_store=ResponseStoreSettings(path=str(path))
    ) as a:
        made = sdk(a).responses.create(model="tiny", input="Capital of France?", background=True, temperature=0)
        wait_until(lambda: sdk(a).responses.retrieve(made.id).status == "completed", what="it completed on A")
        whole = events_of(sdk(a), made.id)
        holder = a.app.state.responses.runs.holder
    rewind(path, made.id, whole[-1].sequence_number, holder)  # every event, the row still in_progress
    fake_b = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake_b, response_store=ResponseStoreSettings(path=str(path))) as b:
        done = sdk(b).responses.retrieve(made.id)
        assert b.app.state.responses.runs.adopted == 0 and fake_b.opened == []  # nothing to run again
        events = events_of(sdk(b), made.id)
        sdk(b).responses.create(model="tiny", input="Thanks.", previous_response_id=made.id)
    assert done.model_dump() == whole[-1].response.model_dump()
    assert [e.model_dump() for e in events] == [e.model_dump() for e in whole]
    assert fake_b.opened[0][1].prompt_token_ids == served.encode_chat(
        [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "Thanks."},
        ]
    )


LIGHT = TenantSettings("light", ("key-l",), weight=2.0)


@pytest.mark.parametrize("case", ["kept", "kept by an older router", "not configured here"])
def test_an_adopted_response_runs_for_the_tenant_and_class_kept_with_it_or_for_none(served, tmp_path, case):
    """The sweep adopts it in no request's context: it runs for the tenant and class it was asked with,
    as the adopting router configures them. A response kept without them (a router of an earlier version)
    or for a tenant this router does not configure counts toward no tenant: not the built-in ``default``,
    which would keep a slot free on every server for a tenant that is not asking."""
    path = tmp_path / "responses.sqlite"
    keys = {"api_keys": ("key-l",), "response_store": ResponseStoreSettings(path=str(path))}
    with router(served, FakeWorkerClient(reply=ids(served, ANSWER)), tenants=(LIGHT,), **keys) as a:
        made = sdk(a, "key-l").responses.create(
            model="tiny", input="Capital of France?", background=True, extra_headers={"X-Priority-Class": "batch"}
        )
        wait_until(lambda: sdk(a, "key-l").responses.retrieve(made.id).status == "completed", what="completed on A")
        whole = events_of(sdk(a, "key-l"), made.id)
        holder = a.app.state.responses.runs.holder
        assert a.app.state.responses.store.caller_of(made.id) == KeptCaller("light", "batch")
    last = [e.sequence_number for e in whole if e.type == "response.output_text.delta"][1]
    rewind(path, made.id, last, holder)
    if case == "kept by an older router":
        with sqlite3.connect(path) as db:
            db.execute("DELETE FROM response_callers WHERE response_id = ?", (made.id,))
    tenants = () if case == "not configured here" else (LIGHT,)
    fake_b = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake_b, tenants=tenants, tenant_share_window_s=600.0, **keys) as b:
        runs = b.app.state.responses.runs
        assert b.portal.call(runs.sweep_once) == 1
        wait_until(lambda: runs.runs == {}, what="the adopted response ran to its end")
        done = sdk(b, "key-l").responses.retrieve(made.id)
        admission = b.app.state.handlers.dispatcher.admission
        active, held = admission.shares.active(), admission.shares.holding
        metrics = b.get("/metrics").text.splitlines()
    assert done.status == "completed" and done.output_text == ANSWER
    ((_, sent),) = fake_b.opened
    if case == "kept":
        assert sent.tenant == "light" and active == {"light": Ticket("light", 2.0, 2)}  # batch: the third class
    else:
        assert sent.tenant is None and active == {}  # no tenant's KV share, no tenant made active
    assert held("light") == 0 and held("default") == 0 and admission.held_back == {}
    assert "pdserve_router_background_adoptions_total 1.0" in metrics
