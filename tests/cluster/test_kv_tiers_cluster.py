"""KV tiers through a real 1P1D cluster: a prefill server whose cache is too small for the trace writes
the blocks it evicts to its disk tier (under its own folder), reads them back when a prompt returns,
exports the counts on /metrics, and the greedy tokens still equal transformers. With the shared Redis
store instead, a prefill server killed and restarted by the launcher finds the prompt's blocks there."""

from __future__ import annotations

import json
import os
import signal

import pytest

from engine.prefix_cache import chain_hashes
from tests.engine.oracle import hf_greedy
from tests.redis_server import RedisServer, missing
from tests.support.cluster import MAX_MODEL_LEN, Cluster, start_cluster
from tests.support.oracle import tokenizer
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

P_BLOCKS, D_BLOCKS = 24, 12  # P: 96 tokens in blocks of 4; D: 192 tokens in blocks of 16


def prompt(k: int) -> list[int]:
    return [(29 * i + 101 * k) % 400 + 40 for i in range(60)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    disk = tmp_path_factory.mktemp("kv-tiers")
    c = start_cluster(
        tmp_path_factory,
        "tiny-1p1d",
        tiny_model,
        {
            "max_model_len": MAX_MODEL_LEN,
            "engine": {"kv_tiers": {"disk_path": str(disk), "disk_bytes": 1 << 24}},
        },
        {"p0": {"num_blocks": P_BLOCKS}, "d0": {"num_blocks": D_BLOCKS, "kv_tiers": {}}},
    )
    c.disk = disk
    yield c
    c.stop()


def complete(cluster: Cluster, model: str, tokens: list[int]) -> None:
    """One greedy completion through the router, checked against transformers; then every server idle."""
    r = cluster.client().completions.create(model="tiny", prompt=tokens, max_tokens=8, temperature=0)
    ids = hf_greedy(model, tokens, 8)
    assert r.choices[0].text == tokenizer(model).decode(ids, skip_special_tokens=True)
    cluster.wait_idle(3.0)


def first_blocks(cluster: Cluster) -> list[int]:
    """The hashes of prompt 0's 14 blocks of 4 that a hit loads, as p0 computes them."""
    salt = cluster.http.get(f"{cluster.server('p0')['url']}/kv/blocks").json()["salt"]
    return chain_hashes(salt, prompt(0), 4)[:14]


def test_a_prompt_evicted_from_the_prefill_server_comes_back_from_its_disk_tier_exactly(served, tiny_model):
    for k in range(4):  # prompt 0, then three that push it out of P's cache (and D's)
        complete(served, tiny_model, prompt(k))
    names = {f"{h:016x}.kv" for h in first_blocks(served)}
    wait_until(lambda: names <= {f.name for f in (served.disk / "p0").glob("*/*.kv")}, what="prompt 0's 14 files")
    assert not (served.disk / "d0").exists()  # d0 turned its tiers off
    hits = served.metric("p0", "pdserve_prefix_cache_tier_hits_tokens_total")
    computed = served.metric("p0", 'pdserve_engine_tokens_total{kind="prompt"}')

    complete(served, tiny_model, prompt(0))
    assert served.metric("p0", "pdserve_prefix_cache_tier_hits_tokens_total") - hits == 56  # (60 - 1) // 4 blocks
    assert served.metric("p0", 'pdserve_engine_tokens_total{kind="prompt"}') - computed == 4
    assert served.metric("p0", 'pdserve_kv_tier_hits_total{tier="disk"}') == 14
    assert served.metric("p0", 'pdserve_kv_tier_corrupt_entries_total{tier="disk"}') == 0
    held = served.metric("p0", 'pdserve_kv_tier_held_bytes{tier="disk"}')
    assert 0 < held <= served.metric("p0", 'pdserve_kv_tier_limit_bytes{tier="disk"}') == 1 << 24
    assert {name: b["free"] for name, b in served.blocks().items()} == {"p0": P_BLOCKS, "d0": D_BLOCKS}


@pytest.mark.skipif(missing() is not None, reason=missing() or "")
def test_a_prefill_server_restarted_mid_trace_loads_the_prompt_from_the_shared_store(tmp_path_factory, tiny_model):
    store = RedisServer()
    cluster = None
    try:
        cluster = start_cluster(
            tmp_path_factory,
            "tiny-1p1d",
            tiny_model,
            {"max_model_len": MAX_MODEL_LEN, "engine": {"kv_tiers": {"redis_url": store.url}}},
            {"p0": {"num_blocks": P_BLOCKS}, "d0": {"num_blocks": D_BLOCKS, "kv_tiers": {}}},
        )
        for k in range(4):
            complete(cluster, tiny_model, prompt(k))
        wanted = {f"{h:016x}" for h in first_blocks(cluster)}

        def stored() -> set[str]:
            return {key.decode().rsplit(":", 1)[1] for key in store.client.scan_iter("pdserve:kv:*")}

        wait_until(lambda: wanted <= stored(), what="prompt 0's 14 blocks in the store")

        os.kill(cluster.server("p0")["pid"], signal.SIGKILL)  # its cache, and its counters, are gone

        def restarted() -> bool:
            path = cluster.run_dir / "restarts.json"
            done = json.loads(path.read_text())["restarts"] if path.exists() else []
            return any(r["name"] == "p0" and r["back_after_s"] is not None for r in done)

        wait_until(restarted, 60, "the launcher restarted p0")
        router_health = f"{cluster.router_url}/health"
        wait_until(lambda: all(w["healthy"] for w in cluster.http.get(router_health).json()["workers"]), 30)
        complete(cluster, tiny_model, prompt(0))
        assert cluster.metric("p0", "pdserve_prefix_cache_tier_hits_tokens_total") == 56
        assert cluster.metric("p0", 'pdserve_kv_tier_hits_total{tier="redis"}') == 14
        assert cluster.metric("p0", 'pdserve_engine_tokens_total{kind="prompt"}') == 4
        assert {name: b["free"] for name, b in cluster.blocks().items()} == {"p0": P_BLOCKS, "d0": D_BLOCKS}
    finally:
        if cluster is not None:
            cluster.stop()
        store.stop()
