"""KV tiers through a real 1P1D cluster: a prefill server whose cache is too small for the trace writes
the blocks it evicts to its disk tier (under its own folder), reads them back when a prompt returns,
exports the counts on /metrics, and the greedy tokens still equal transformers."""

from __future__ import annotations

import pytest

from engine.prefix_cache import chain_hashes
from tests.engine.oracle import hf_greedy
from tests.support.cluster import MAX_MODEL_LEN, start_cluster
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


def test_a_prompt_evicted_from_the_prefill_server_comes_back_from_its_disk_tier_exactly(served, tiny_model):
    client = served.client()

    def complete(tokens: list[int]) -> None:
        r = client.completions.create(model="tiny", prompt=tokens, max_tokens=8, temperature=0)
        ids = hf_greedy(tiny_model, tokens, 8)
        assert r.choices[0].text == tokenizer(tiny_model).decode(ids, skip_special_tokens=True)
        served.wait_idle(3.0)

    for k in range(4):  # prompt 0, then three that push it out of P's cache (and D's)
        complete(prompt(k))
    salt = served.http.get(f"{served.server('p0')['url']}/kv/blocks").json()["salt"]
    names = {f"{h:016x}.kv" for h in chain_hashes(salt, prompt(0), 4)[:14]}
    wait_until(lambda: names <= {f.name for f in (served.disk / "p0").glob("*/*.kv")}, what="prompt 0's 14 files")
    assert not (served.disk / "d0").exists()  # d0 turned its tiers off
    hits = served.metric("p0", "pdserve_prefix_cache_tier_hits_tokens_total")
    computed = served.metric("p0", 'pdserve_engine_tokens_total{kind="prompt"}')

    complete(prompt(0))
    assert served.metric("p0", "pdserve_prefix_cache_tier_hits_tokens_total") - hits == 56  # (60 - 1) // 4 blocks
    assert served.metric("p0", 'pdserve_engine_tokens_total{kind="prompt"}') - computed == 4
    assert served.metric("p0", 'pdserve_kv_tier_hits_total{tier="disk"}') == 14
    assert served.metric("p0", 'pdserve_kv_tier_corrupt_entries_total{tier="disk"}') == 0
    held = served.metric("p0", 'pdserve_kv_tier_held_bytes{tier="disk"}')
    assert 0 < held <= served.metric("p0", 'pdserve_kv_tier_limit_bytes{tier="disk"}') == 1 << 24
    assert {name: b["free"] for name, b in served.blocks().items()} == {"p0": P_BLOCKS, "d0": D_BLOCKS}
