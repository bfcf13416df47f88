"""Cache-aware routing through a real 1P2D cluster (configs/1p2d.yaml: P blocks of 16,
d0 blocks of 32, d1 blocks of 8): the router's index mirrors the hashes each decode
server holds, a request sharing a prefix goes to the server holding it and reuses it,
and the greedy tokens equal transformers."""

from __future__ import annotations

import time

import pytest

from tests.engine.oracle import hf_greedy
from tests.support.cluster import start_cluster
from tests.support.oracle import tokenizer

pytestmark = pytest.mark.integration

A = [(29 * i) % 400 + 40 for i in range(110)]
B = [(37 * i) % 400 + 45 for i in range(110)]
HITS = "pdserve_prefix_cache_hits_tokens_total"
THRESHOLD = 16  # a prompt whose uncached part on the chosen decode server is shorter: prefilled there
PREFILLED = 'pdserve_requests_total{outcome="ok"}'
LOCAL = 'pdserve_request_paths_total{path="local_prefill"}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    c = start_cluster(
        tmp_path_factory,
        "1p2d",
        tiny_model,
        {
            "max_model_len": 1024,
            "router": {"policy": "cache_aware", "kv_events_interval_s": 0.05, "local_prefill_threshold": THRESHOLD},
        },
    )
    yield c
    c.stop()


def router_index(c) -> dict:
    return c.http.get(f"{c.router_url}/debug/kv_index").json()["workers"]


def wait_synced(c, timeout: float = 10.0) -> dict:
    """Until the router's index of each decode server is at that server's last event."""
    deadline = time.monotonic() + timeout
    while True:
        index = router_index(c)
        last = {d: c.http.get(f"{c.server(d)['url']}/kv/events", params={"after": 10**9}).json() for d in ("d0", "d1")}
        if all(
            d in index and (index[d]["epoch"], index[d]["seq"]) == (last[d]["epoch"], last[d]["last"]) for d in last
        ):
            return index
        if time.monotonic() > deadline:
            raise AssertionError(f"router index {index} never caught up with {last}")
        time.sleep(0.02)


def complete(c, tiny_model, prompt: list[int]) -> tuple[int, dict[str, float]]:
    """Cached tokens reported, and each decode server's prefix-cache hits for this request."""
    before = {d: c.metric(d, HITS) for d in ("d0", "d1")}
    r = c.client().completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    ids = hf_greedy(tiny_model, prompt, 6)
    assert r.choices[0].text == tokenizer(tiny_model).decode(ids, skip_special_tokens=True)
    c.wait_idle(3.0)
    return r.usage.prompt_tokens_details.cached_tokens, {d: c.metric(d, HITS) - before[d] for d in before}


def test_requests_sharing_a_prefix_go_to_the_server_holding_it(served, tiny_model):
    c = served
    assert complete(c, tiny_model, A) == (0, {"d0": 0, "d1": 0})  # nothing cached: a tie, config order: d0
    # d1 takes B while d0 is out of rotation
    assert c.http.post(f"{c.router_url}/admin/workers/d0/drain").status_code == 200
    assert complete(c, tiny_model, B) == (0, {"d0": 0, "d1": 0})
    assert c.http.post(f"{c.router_url}/admin/workers/d0/resume").status_code == 200
    index = wait_synced(c)
    for d in ("d0", "d1"):  # the router holds exactly the hashes each server holds
        assert index[d]["blocks"] == len(c.http.get(f"{c.server(d)['url']}/kv/blocks").json()["hashes"])
    # 110 prompt tokens and 5 computed answer tokens (the 6th is sampled, never computed)
    assert (index["d0"]["blocks"], index["d1"]["blocks"]) == (115 // 32, 115 // 8)

    for i in range(3):
        suffix = [300 + 7 * i + k for k in range(20)]  # 24 tokens uncached: over the threshold
        # 100 shared tokens: d0 holds 3 blocks of 32 of them, d1 12 blocks of 8: 96 either way
        assert complete(c, tiny_model, A[:100] + suffix) == (96, {"d0": 96, "d1": 0})
        assert complete(c, tiny_model, B[:100] + suffix) == (96, {"d0": 0, "d1": 96})
    assert all(w["resyncs"] == 1 for w in wait_synced(c).values())  # one snapshot at start, events since


def test_a_rediscovered_server_is_reloaded_from_its_snapshot_and_routing_stays_exact(served, tiny_model):
    """The router forgets d1 and discovers it again: its index starts afresh from d1's snapshot
    (GET /kv/blocks), as after lost events or a new epoch (tests/router/cluster/test_kv_index.py)."""
    c = served
    before = wait_synced(c)
    assert c.http.delete(f"{c.router_url}/admin/workers/d1").status_code == 200
    assert c.http.post(f"{c.router_url}/admin/workers", json={"url": c.server("d1")["url"]}).status_code == 200
    deadline = time.monotonic() + 10
    while "d1" not in router_index(c) or router_index(c)["d1"]["epoch"] is None:
        assert time.monotonic() < deadline, router_index(c)
        time.sleep(0.02)
    after = wait_synced(c)
    assert after["d1"]["blocks"] == before["d1"]["blocks"] and after["d1"]["resyncs"] == 1
    assert complete(c, tiny_model, B[:100] + [9, 8, 7, 6]) == (96, {"d0": 0, "d1": 96})


def test_a_request_whose_uncached_part_is_short_is_prefilled_on_the_decode_server_holding_the_rest(served, tiny_model):
    c = served
    wait_synced(c)
    counts = lambda: (c.metric("p0", PREFILLED), c.metric("d0", LOCAL), c.metric("d1", LOCAL))  # noqa: E731
    before = counts()
    # 100 + 10 tokens: d0 holds 96 of them (blocks of 32), 14 are left, under the threshold
    assert complete(c, tiny_model, A[:100] + list(range(440, 450))) == (96, {"d0": 96, "d1": 0})
    assert counts() == (before[0], before[1] + 1, before[2])
    # 100 + 30 tokens: 34 left, over it: the prefill server computes them
    assert complete(c, tiny_model, A[:100] + list(range(450, 480))) == (96, {"d0": 96, "d1": 0})
    assert counts() == (before[0] + 1, before[1] + 1, before[2])
