"""Background responses (router/api/background.py) on a real 1P1D cluster with the openai SDK: a stream read
in part, resumed on a new connection after its last event, gives every event once, in order, and the text
of the same request answered in the foreground (and by transformers); a cancel mid-generation frees every
KV block; a response polled to its end; a router killed mid-response, its response adopted by another. The
decode server pauses after its k-th token (server_common.faults), so "mid-generation" is a place in the
answer, not a moment."""

from __future__ import annotations

import os
import signal

import openai
import pytest
import yaml

from tests.engine.oracle import hf_greedy
from tests.support.cluster import Cluster, free_ports, make_config
from tests.support.oracle import tokenizer
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

QUESTION = "Write a long story about the sea."
MAX_TOKENS = 48
LONG_TOKENS = 120  # a response long enough to be mid-generation when its router dies
PAUSE_S = 30.0  # the longest the decode server stays paused if a test fails before releasing it


@pytest.fixture
def cluster(one_p_one_d):
    return one_p_one_d


def arm(served, **plan) -> None:
    """The decode server's faults (an empty plan disarms, and releases a pause)."""
    served.http.post(f"{served.server('d0')['url']}/admin/faults", json=plan).raise_for_status()


def paused(served) -> bool:
    return served.http.get(f"{served.server('d0')['url']}/admin/faults").json()["stalled"]


def fresh_client(served) -> openai.OpenAI:
    """A client of its own: its requests go on new connections."""
    return openai.OpenAI(base_url=f"{served.router_url}/v1", api_key="test", max_retries=0)


def greedy_answer(path: str, question: str, max_tokens: int) -> str:
    """What transformers answers greedily to ``question`` as the one user message."""
    tok = tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    return tok.decode(hf_greedy(path, prompt, max_tokens), skip_special_tokens=True)


def deltas(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_stream_resumed_on_a_new_connection_has_every_event_once_and_the_foreground_text(served, tiny_model):
    body = dict(model="tiny", input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    foreground = served.client().responses.create(**body)
    assert foreground.output_text == greedy_answer(tiny_model, QUESTION, MAX_TOKENS)
    arm(served, pause_after_tokens=12, pause_timeout_s=PAUSE_S)
    try:
        made = served.client().responses.create(**body, background=True)
        assert made.status in ("queued", "in_progress") and made.background is True
        first = []
        with fresh_client(served) as reader, reader.responses.retrieve(made.id, stream=True) as live:
            for event in live:  # left after two deltas, the decode server paused further on
                first.append(event)
                if len([e for e in first if e.type == "response.output_text.delta"]) == 2:
                    break
        wait_until(lambda: paused(served), 10, "the decode server paused after its 12th token")
        rest = []
        after = first[-1].sequence_number
        with fresh_client(served) as reader, reader.responses.retrieve(made.id, stream=True, starting_after=after) as s:
            for event in s:
                if not rest:  # stored before the pause; what follows the release is streamed live
                    arm(served)
                rest.append(event)
    finally:
        arm(served)
    both = first + rest
    assert [e.sequence_number for e in both] == list(range(len(both)))
    assert rest[-1].type == "response.completed"
    assert deltas(both) == foreground.output_text == rest[-1].response.output_text
    done = served.client().responses.retrieve(made.id)
    assert done.status == foreground.status and done.output_text == foreground.output_text
    assert served.wait_idle() >= 0
    assert all(b["free"] == b["total"] for b in served.blocks().values())


def test_cancel_mid_generation_frees_every_kv_block_and_answers_cancelled(served):
    aborted = served.metric("d0", 'pdserve_requests_total{outcome="aborted"}')
    arm(served, pause_after_tokens=4, pause_timeout_s=PAUSE_S)
    try:
        made = served.client().responses.create(
            model="tiny", input=QUESTION, max_output_tokens=400, temperature=0, background=True
        )
        wait_until(lambda: paused(served), 10, "the decode server paused after its 4th token")
        assert served.blocks()["d0"]["running"] > 0
        cancelled = served.client().responses.cancel(made.id)
        assert cancelled.status == "cancelled" and cancelled.id == made.id
    finally:
        arm(served)  # the engine goes on, and finds the sequence aborted
    served.wait_idle(timeout=3.0)
    assert all(b["free"] == b["total"] for b in served.blocks().values())
    assert served.metric("d0", 'pdserve_requests_total{outcome="aborted"}') == aborted + 1
    again = served.client().responses.cancel(made.id)  # ended: its final state, no error
    stored = served.client().responses.retrieve(made.id)
    assert again.status == "cancelled" and again.model_dump() == stored.model_dump()
    events = list(served.client().responses.retrieve(made.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert deltas(events) == "".join(part.text for item in cancelled.output for part in item.content)


def test_a_background_response_polled_to_its_end_equals_transformers(served, tiny_model):
    client = served.client()
    made = client.responses.create(
        model="tiny", input="Name a river.", max_output_tokens=16, temperature=0, background=True
    )
    wait_until(lambda: client.responses.retrieve(made.id).status not in ("queued", "in_progress"), 30, "it ended")
    done = client.responses.retrieve(made.id)
    assert done.status in ("completed", "incomplete") and done.background is True
    assert done.output_text == greedy_answer(tiny_model, "Name a river.", 16)
    with pytest.raises(openai.BadRequestError):
        list(client.responses.retrieve(made.id, stream=True, starting_after=10**6))


@pytest.mark.slow
def test_a_router_killed_mid_response_is_adopted_by_the_other_and_the_resumed_stream_is_whole(
    tmp_path_factory, tiny_model
):
    """Two routers (router.replicas, one SQLite store) in front of 1P1D. Router 0 runs a background
    response; killed (SIGKILL) with the decode server paused after its 4th token, it stops renewing its
    lease and its stream drops, so the decode server frees the sequence. Once the lease lapses, one router
    adopts it (router 1 on the client's resumed stream, or whichever sweeps first) and runs it again; the
    client, resumed on router 1 with the SDK after the last event it read, has every event once, in order,
    and transformers' greedy text."""
    folder = tmp_path_factory.mktemp("two-routers")
    config = make_config(
        folder,
        "tiny-1p1d",
        tiny_model,
        {"fault_injection": True, "engine": {"prefix_caching": False}, "router": {"replicas": 2}},
    )
    data = yaml.safe_load(config.read_text())
    taken = {data["router"]["port"], *(i[k] for i in (*data["prefill"], *data["decode"]) for k in ("port", "kv_port"))}
    data["router"]["replica_ports"] = [p for p in free_ports(8) if p not in taken][:2]
    config.write_text(yaml.safe_dump(data))
    c = Cluster(config, folder)
    try:
        routers = {p["name"]: p for p in c.manifest["processes"] if p["role"] == "router"}
        clients = {
            n: openai.OpenAI(base_url=f"{p['url']}/v1", api_key="test", max_retries=0) for n, p in routers.items()
        }
        for name, router in routers.items():
            wait_until(
                lambda url=router["url"]: all(w["healthy"] for w in c.http.get(f"{url}/health").json()["workers"]),
                30,
                f"every server in {name}'s rotation",
            )
        arm(c, pause_after_tokens=4, pause_timeout_s=PAUSE_S)
        made = clients["router-0"].responses.create(
            model="tiny", input=QUESTION, max_output_tokens=LONG_TOKENS, temperature=0, background=True
        )
        first = []
        with clients["router-0"].responses.retrieve(made.id, stream=True) as live:
            for event in live:
                first.append(event)
                if event.type == "response.output_text.delta":
                    break
        wait_until(lambda: paused(c), 10, "the decode server paused after its 4th token")
        os.kill(routers["router-0"]["pid"], signal.SIGKILL)
        arm(c)
        c.wait_idle(timeout=10.0)  # the dead router's stream dropped: the decode server aborted the sequence
        assert all(b["free"] == b["total"] for b in c.blocks().values())

        after = first[-1].sequence_number
        rest = list(clients["router-1"].responses.retrieve(made.id, stream=True, starting_after=after))
        both = first + rest
        assert [e.sequence_number for e in both] == list(range(len(both)))
        assert rest[-1].type == "response.completed"
        expected = greedy_answer(tiny_model, QUESTION, LONG_TOKENS)
        assert deltas(both) == expected
        done = clients["router-1"].responses.retrieve(made.id)
        assert done.status in ("completed", "incomplete") and done.output_text == expected
        assert rest[-1].response.output_text == expected
        c.wait_idle(timeout=10.0)
        assert all(b["free"] == b["total"] for b in c.blocks().values())
        adopted = f"background response {made.id}: its router is gone; carried on here after event"
        logs = [(folder / f"{name}.log").read_text() for name in routers]  # router-0's: its restart's too
        assert sum(log.count(adopted) for log in logs) == 1  # one router adopted it, once
        for client in clients.values():
            client.close()
    finally:
        c.stop()
