"""Background responses (router/api/background.py) through the official openai SDK against the router, its
workers scripted (no servers): created at once, polled, streamed again from a sequence number, cancelled;
bounded logs; bad input; two routers sharing one store."""

from __future__ import annotations

import time

import openai
import pytest

from router.api.background import sse_of
from router.api.model import ServedModel
from router.api.response_store import StoredResponse, owner_of
from router.settings import ResponseStoreSettings
from tests.router.api.test_responses import ids, router, sdk
from tests.support.fakes import FakeWorkerClient
from tests.waiting import wait_until

ANSWER = "Paris is the capital of France, and a large city on the Seine."
SLOW_S = 0.5  # per token: an answer of a dozen tokens is still running when a test cancels it


@pytest.fixture(scope="module")
def served(tiny_model) -> ServedModel:
    return ServedModel.load("tiny", tiny_model)


def stored_events(c, response_id: str) -> int:
    return c.app.state.responses.store.event_count(response_id)


def status(client: openai.OpenAI, response_id: str) -> str:
    return client.responses.retrieve(response_id).status


def test_a_background_response_answers_queued_and_polls_to_the_streamed_answer(served):
    fake = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake) as c:
        client = sdk(c)
        made = client.responses.create(model="tiny", input="Capital of France?", background=True, temperature=0)
        assert made.status == "queued" and made.background is True and made.output == []
        wait_until(lambda: status(client, made.id) == "completed", what="the response completed")
        done = client.responses.retrieve(made.id)
        assert done.output_text == ANSWER and done.background is True and done.usage.output_tokens > 0
        streamed = list(client.responses.create(model="tiny", input="Capital of France?", stream=True))
        events = list(client.responses.retrieve(made.id, stream=True))
    assert [e.type for e in events] == [e.type for e in streamed]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.model_dump() == done.model_dump()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER


def test_a_stream_resumed_after_event_n_has_every_later_event_once_in_order(served):
    fake = FakeWorkerClient(reply=ids(served, ANSWER), delay=0.01)
    with router(served, fake) as c:
        client = sdk(c)
        made = client.responses.create(model="tiny", input="Capital of France?", background=True)
        first = []
        with client.responses.retrieve(made.id, stream=True) as live:  # left after a few deltas
            for event in live:
                first.append(event)
                if event.type == "response.output_text.delta" and event.sequence_number >= 6:
                    break
        rest = list(client.responses.retrieve(made.id, stream=True, starting_after=first[-1].sequence_number))
        whole = list(client.responses.retrieve(made.id, stream=True))
    both = first + rest
    assert [e.sequence_number for e in both] == list(range(len(both)))
    assert [e.model_dump() for e in both] == [e.model_dump() for e in whole]
    assert "".join(e.delta for e in both if e.type == "response.output_text.delta") == ANSWER
    assert rest[-1].type == "response.completed"


def test_background_with_stream_answers_its_events(served):
    fake = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake) as c:
        events = list(sdk(c).responses.create(model="tiny", input="hi", background=True, stream=True))
    assert events[0].type == "response.created" and events[0].response.background is True
    assert events[-1].type == "response.completed" and events[-1].response.output_text == ANSWER


def test_cancel_stops_the_generation_on_the_servers_and_answers_cancelled(served):
    fake = FakeWorkerClient(reply=ids(served, ANSWER), delay=SLOW_S)
    with router(served, fake) as c:
        client = sdk(c)
        made = client.responses.create(model="tiny", input="Capital of France?", background=True)
        wait_until(lambda: stored_events(c, made.id) >= 5, what="the first text delta stored")
        cancelled = client.responses.cancel(made.id)
        assert cancelled.status == "cancelled" and cancelled.id == made.id
        (message,) = cancelled.output
        assert message.status == "incomplete" and ANSWER.startswith(message.content[0].text)
        assert [rid for _, rid in fake.aborts] == [made.id.removeprefix("resp_")] * len(fake.aborts) != []
        assert all(s.closed for s in fake.streams)
        assert client.responses.retrieve(made.id).status == "cancelled"
        assert client.responses.cancel(made.id).model_dump() == client.responses.retrieve(made.id).model_dump()
        events = list(client.responses.retrieve(made.id, stream=True))  # what it streamed; then the stream ends
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == message.content[0].text


def test_cancel_of_a_finished_response_answers_its_final_state(served):
    fake = FakeWorkerClient(reply=ids(served, "Paris."))
    with router(served, fake) as c:
        client = sdk(c)
        made = client.responses.create(model="tiny", input="Capital of France?", background=True)
        wait_until(lambda: status(client, made.id) == "completed", what="the response completed")
        again = client.responses.cancel(made.id)
        assert again.status == "completed" and again.output_text == "Paris." and fake.aborts == []


def test_a_response_past_the_event_limit_stops_and_ends_failed(served):
    fake = FakeWorkerClient(reply=ids(served, ANSWER))
    with router(served, fake, response_store=ResponseStoreSettings(max_events=8)) as c:
        client = sdk(c)
        made = client.responses.create(model="tiny", input="Capital of France?", background=True)
        wait_until(lambda: status(client, made.id) == "failed", what="the response failed")
        failed = client.responses.retrieve(made.id)
        events = list(client.responses.retrieve(made.id, stream=True))
    assert failed.error.code == "server_error" and "8 events" in failed.error.message
    assert [e.sequence_number for e in events] == list(range(8)) and events[-1].type == "response.failed"
    assert events[-1].response.model_dump() == failed.model_dump()
    assert fake.aborts != [] and all(s.closed for s in fake.streams)


def test_bad_background_requests_are_refused_as_openai_does(served):
    fake = FakeWorkerClient(reply=ids(served, "ok"))
    with router(served, fake, api_keys=("key-a", "key-b")) as c:
        a, b = sdk(c, "key-a"), sdk(c, "key-b")
        with pytest.raises(openai.BadRequestError) as no_store:
            a.responses.create(model="tiny", input="hi", background=True, store=False)
        assert no_store.value.body["param"] == "background"
        made = a.responses.create(model="tiny", input="hi", background=True)
        wait_until(lambda: status(a, made.id) == "completed", what="the response completed")
        last = stored_events(c, made.id) - 1
        for after in (-1, last + 1, 10**6):
            with pytest.raises(openai.BadRequestError) as refused:
                list(a.responses.retrieve(made.id, stream=True, starting_after=after))
            assert refused.value.body["param"] == "starting_after"
        assert list(a.responses.retrieve(made.id, stream=True, starting_after=last)) == []
        for call in (
            lambda: b.responses.retrieve(made.id),
            lambda: list(b.responses.retrieve(made.id, stream=True, starting_after=0)),
            lambda: b.responses.cancel(made.id),
            lambda: a.responses.cancel("resp_nope"),
            lambda: list(a.responses.retrieve("resp_nope", stream=True)),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        foreground = a.responses.create(model="tiny", input="hi")
        with pytest.raises(openai.BadRequestError):
            list(a.responses.retrieve(foreground.id, stream=True))
        with pytest.raises(openai.BadRequestError):
            a.responses.cancel(foreground.id)


def test_a_router_sharing_the_store_streams_and_cancels_a_response_running_on_another(served, tmp_path):
    store = ResponseStoreSettings(path=str(tmp_path / "responses.sqlite"))
    fake_a = FakeWorkerClient(reply=ids(served, ANSWER), delay=SLOW_S)
    fake_b = FakeWorkerClient(reply=ids(served, "unused"))
    with router(served, fake_a, response_store=store) as a, router(served, fake_b, response_store=store) as b:
        made = sdk(a).responses.create(model="tiny", input="Capital of France?", background=True)
        seen = []
        with sdk(b).responses.retrieve(made.id, stream=True) as live:  # b reads what a writes
            for event in live:
                seen.append(event)
                if event.type == "response.output_text.delta":
                    break
        cancelled = sdk(b).responses.cancel(made.id)  # through the store: a stops it
        assert cancelled.status == "cancelled" and fake_a.aborts != [] and fake_b.opened == []
        assert sdk(a).responses.retrieve(made.id).status == "cancelled"
        events = list(sdk(b).responses.retrieve(made.id, stream=True))
    assert [e.model_dump() for e in events[: len(seen)]] == [e.model_dump() for e in seen]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_running_response_cannot_be_continued_and_deleting_it_stops_it_first(served):
    fake = FakeWorkerClient(reply=ids(served, ANSWER), delay=SLOW_S)
    with router(served, fake) as c:
        client = sdk(c)
        made = client.responses.create(model="tiny", input="Capital of France?", background=True)
        wait_until(lambda: stored_events(c, made.id) >= 5, what="the first text delta stored")
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="tiny", input="And of Italy?", previous_response_id=made.id)
        assert refused.value.body["param"] == "previous_response_id" and "in_progress" in refused.value.body["message"]
        client.responses.delete(made.id)
        assert fake.aborts != [] and all(s.closed for s in fake.streams)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)
        assert c.app.state.responses.runs.runs == {} and stored_events(c, made.id) == 0


def test_starting_after_must_fit_a_sequence_number(served):
    fake = FakeWorkerClient(reply=ids(served, ANSWER), delay=SLOW_S)
    with router(served, fake) as c:
        made = sdk(c).responses.create(model="tiny", input="hi", background=True)
        with pytest.raises(openai.BadRequestError) as refused:
            list(sdk(c).responses.retrieve(made.id, stream=True, starting_after=2**63))  # running: not yet checkable
        assert refused.value.body["param"] == "starting_after"
        sdk(c).responses.cancel(made.id)


def orphan(store, response_id: str, text: str) -> None:
    """A background response left in_progress by a router gone since: its lease expired, two events logged."""
    response = {"id": response_id, "object": "response", "background": True, "status": "in_progress", "output": []}
    store.put(StoredResponse(response_id, owner_of(None), time.time(), response, [], []))
    store.renew_lease(response_id, "router-gone", time.time() - 1)
    added = {"type": "message", "id": "msg_0", "role": "assistant", "status": "in_progress", "content": []}
    logged = [
        {"type": "response.output_item.added", "sequence_number": 0, "output_index": 0, "item": added},
        {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_0", "delta": text},
    ]
    store.append_events(response_id, [(e["sequence_number"], sse_of(e)) for e in logged])


def test_a_response_whose_router_is_gone_ends_failed_when_read_and_cancelled_when_cancelled(served, tmp_path):
    fake = FakeWorkerClient(reply=ids(served, "unused"))
    with router(served, fake, response_store=ResponseStoreSettings(path=str(tmp_path / "r.sqlite"))) as c:
        store = c.app.state.responses.store
        orphan(store, "resp_polled", "Par")
        orphan(store, "resp_streamed", "Ro")
        orphan(store, "resp_cancelled", "Ber")
        polled = sdk(c).responses.retrieve("resp_polled")
        assert polled.status == "failed" and polled.error.message == "the router running it stopped"
        assert polled.output[0].status == "incomplete" and polled.output[0].content[0].text == "Par"
        events = list(sdk(c).responses.retrieve("resp_streamed", stream=True))
        assert [(e.type, e.sequence_number) for e in events][1:] == [
            ("response.output_text.delta", 1),
            ("response.failed", 2),
        ]
        assert events[-1].response.model_dump() == sdk(c).responses.retrieve("resp_streamed").model_dump()
        cancelled = sdk(c).responses.cancel("resp_cancelled")
        assert cancelled.status == "cancelled" and cancelled.output[0].content[0].text == "Ber"
        assert store.event_count("resp_cancelled") == 2 and fake.opened == []


def test_a_router_that_stops_ends_its_running_responses_failed(served, tmp_path):
    store = ResponseStoreSettings(path=str(tmp_path / "responses.sqlite"))
    fake = FakeWorkerClient(reply=ids(served, ANSWER), delay=SLOW_S)
    with router(served, fake, response_store=store) as a:
        made = sdk(a).responses.create(model="tiny", input="Capital of France?", background=True)
        wait_until(lambda: stored_events(a, made.id) >= 5, what="the first text delta stored")
    assert fake.aborts != [] and all(s.closed for s in fake.streams)
    with router(served, FakeWorkerClient(reply=[]), response_store=store) as b:
        failed = sdk(b).responses.retrieve(made.id)
        events = list(sdk(b).responses.retrieve(made.id, stream=True))
    assert failed.status == "failed" and failed.error.message == "the router stopped"
    assert events[-1].type == "response.failed" and events[-1].response.model_dump() == failed.model_dump()
    assert [e.sequence_number for e in events] == list(range(len(events)))
