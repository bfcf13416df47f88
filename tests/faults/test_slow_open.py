"""A decode server's open slower than the router's ``stream_stall_s``, on a real 1P1D: the router gives up
on the open, aborts it there and opens the request again on the same decode server, under another attempt
id (``router.cluster.dispatch.OpenIds``), so the reopen never meets its own earlier attempt (409
``duplicate_request``). The client gets 200 and exactly the greedy answer; the open given up on, held
before its reservation (``hold_opens``) until after the answer, then reserves and frees its blocks at
once; afterwards every block on every server is free and nothing of the request is left on either."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.faults.harness import FaultCluster, fault_config
from tests.support.oracle import expected_chat
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

STALL_S = 3  # the least the config takes: thrice the decode server's heartbeat (1 s)
MESSAGES = [{"role": "user", "content": "Why does a reservation need a lease?"}]
MAX_TOKENS = 12
WAIT_S = 60.0
PER_REQUEST = (  # what a server keeps per request (GET /debug/bookkeeping), 0 once idle
    *("active", "streams", "awaiting", "cancelling", "unfilled_claims", "receiver_transfers"),  # decode
    *("jobs", "transfers", "pending", "sender_transfers"),  # prefill
    "engine_requests",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("slow_open")
    changes = {"router": {"stream_stall_s": STALL_S, "health_interval_s": 0.5, "health_backoff_max_s": 1.0}}
    c = FaultCluster(fault_config(folder, tiny_model, 1, 1, changes), folder)
    yield c
    c.stop()


def streamed_chat(url: str) -> tuple[int, list[dict], bool]:
    """A greedy streamed chat request: its status, its events, whether [DONE] came."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    events, done = [], False
    with httpx.Client(timeout=WAIT_S) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.json()], False
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
        return resp.status_code, events, done


def test_an_open_slower_than_the_stall_time_is_opened_again_under_another_id(cluster, tiny_model):
    d0 = cluster.decode[0]
    reservations = 'pdserve_request_paths_total{path="remote_kv"}'
    expired = 'pdserve_transfer_failures_total{outcome="lease_expired"}'
    before, expired_before = cluster.metric(d0, reservations), cluster.metric(d0, expired)
    cluster.arm(d0, hold_opens=1, pause_timeout_s=30)  # released below, once the client has its answer
    status, events, done = streamed_chat(cluster.router_url)
    assert status == 200, events
    assert done and not [e for e in events if "error" in e], events[-3:]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == expected_chat(tiny_model, MESSAGES, MAX_TOKENS)[0]
    assert len({e["id"] for e in events}) == 1
    faults = cluster.faults(d0)
    # The first open is still held: the answer came from the reopened attempt, after stream_stall_s.
    assert (faults["injected"]["opens_held"], faults["held_opens"]) == (1, 1), faults
    assert cluster.metric(d0, reservations) == before + 1
    cluster.release(d0)
    # The first open goes on, aborted meanwhile: it reserves its blocks, then frees them at once.
    wait_until(lambda: cluster.metric(d0, reservations) == before + 2, WAIT_S, "the first open's reservation")
    wait_until(
        lambda: all(not left(cluster, name) for name in cluster.servers()), WAIT_S, "nothing left of the request"
    )
    held, blocks = cluster.leaked_blocks(WAIT_S)
    assert held == 0 and all(b["free"] == b["total"] for b in blocks.values()), blocks
    assert cluster.metric(d0, expired) == expired_before  # freed when aborted, not by its lease running out


def left(cluster: FaultCluster, name: str) -> dict[str, int]:
    """What server ``name`` still keeps of requests: the per-request entries of its bookkeeping not at 0."""
    sizes = cluster.http.get(f"{cluster.url(name)}/debug/bookkeeping").json()["sizes"]
    return {k: n for k, n in sizes.items() if k in PER_REQUEST and n}
