"""Per-tenant shares of the shared KV store through a real 1P1D cluster with two API keys: the router sends each
request's tenant (its name, not its key) to the servers, the prefill server charges the blocks it publishes to
that tenant, and a tenant flooding the store past its share evicts only its own blocks: the other tenant's
prompt, pushed out of every server's cache meanwhile, is loaded back from the store, and the tokens equal
transformers'. The store's counters equal the bytes it holds, block by block, and every block is free after."""

from __future__ import annotations

import json

import openai
import pytest

from engine.prefix_cache import chain_hashes
from engine.tiers.disk import HEADER
from tests.engine.oracle import hf_greedy
from tests.engine.test_kv_tier_redis_shares import accounts_exact
from tests.redis_server import RedisServer, missing
from tests.support.cluster import MAX_MODEL_LEN, Cluster, start_cluster
from tests.support.oracle import tokenizer
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.skipif(missing() is not None, reason=missing() or "")]

P_BLOCKS, D_BLOCKS, BS = 24, 12, 4  # P: 96 tokens in blocks of 4; D: 192 tokens in blocks of 16
PROMPT_BLOCKS = 15  # a prompt's 60 tokens fill 15 of P's blocks, all published when P frees them
SHARE_BLOCKS = 20  # each tenant's share: one prompt fits, three do not
KEYS = {"quiet": "key-quiet-0123456789", "flood": "key-flood-0123456789"}


def prompt(k: int) -> list[int]:
    return [(29 * i + 101 * k) % 400 + 40 for i in range(60)]


def value_bytes(model: str) -> int:
    """What the store holds for one of P's blocks: the header and the K/V of every layer (float32)."""
    config = json.loads(open(f"{model}/config.json").read())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return HEADER.size + config["num_hidden_layers"] * 2 * BS * config["num_key_value_heads"] * head_dim * 4


class Tenants:
    """One OpenAI client per tenant's key, closed with it."""

    def __init__(self, cluster: Cluster) -> None:
        self.clients = {
            name: openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key=key, max_retries=0)
            for name, key in KEYS.items()
        }

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def complete(cluster: Cluster, tenants: Tenants, tenant: str, model: str, tokens: list[int]) -> None:
    r = tenants.clients[tenant].completions.create(model="tiny", prompt=tokens, max_tokens=8, temperature=0)
    assert r.choices[0].text == tokenizer(model).decode(hf_greedy(model, tokens, 8), skip_special_tokens=True)
    cluster.wait_idle(3.0)


def test_a_tenant_flooding_the_store_evicts_only_its_own_blocks_and_the_other_s_prefix_still_loads(
    tmp_path_factory, tiny_model
):
    value = value_bytes(tiny_model)
    store = RedisServer(policy="noeviction")
    cluster = tenants = None
    try:
        tiers = {"redis_url": store.url, "redis_max_bytes_per_tenant": SHARE_BLOCKS * value}
        router = {"tenants": [{"name": name, "keys": [key]} for name, key in KEYS.items()]}
        cluster = start_cluster(
            tmp_path_factory,
            "tiny-1p1d",
            tiny_model,
            {"max_model_len": MAX_MODEL_LEN, "engine": {"kv_tiers": tiers}, "router": router},
            {"p0": {"num_blocks": P_BLOCKS}, "d0": {"num_blocks": D_BLOCKS, "kv_tiers": {}}},
        )
        tenants = Tenants(cluster)
        complete(cluster, tenants, "quiet", tiny_model, prompt(0))
        for k in (1, 2, 3):  # 45 blocks into a share of 20; they also push prompt 0 out of P's and D's caches
            complete(cluster, tenants, "flood", tiny_model, prompt(k))

        salt = cluster.http.get(f"{cluster.server('p0')['url']}/kv/blocks").json()["salt"]

        def stored(k: int) -> int:
            """How many of prompt ``k``'s blocks the store holds."""
            held = {key.decode().rsplit(":", 1)[1] for key in store.client.scan_iter("pdserve:kv:*")}
            return sum(f"{h:016x}" in held for h in chain_hashes(salt, prompt(k), BS))

        # The writes are asynchronous and in order: the flood's last block stored, every write is done.
        wait_until(lambda: stored(3) == PROMPT_BLOCKS, what="the flood's last prompt in the store")
        assert [stored(k) for k in range(4)] == [15, 0, 5, 15]  # the flood's 20 newest, the quiet's all
        (namespace,) = {k.decode().split(":")[2] for k in store.client.scan_iter("pdserve:kvshare:*:bytes")}
        names = (f"pdserve:kv:{namespace}:", f"pdserve:kvshare:{namespace}:")  # P's layout: d0 has no tiers
        full = {"quiet": PROMPT_BLOCKS * value, "flood": SHARE_BLOCKS * value}
        assert accounts_exact(store, *names) == full

        complete(cluster, tenants, "quiet", tiny_model, prompt(0))
        assert cluster.metric("p0", 'pdserve_kv_tier_hits_total{tier="redis"}') == (60 - 1) // BS
        assert cluster.metric("p0", "pdserve_prefix_cache_tier_hits_tokens_total") == (60 - 1) // BS * BS
        # A server's tier counts are read between its engine's steps: up to date after this request.
        evictions = 'pdserve_kv_store_tenant_evictions_total{tenant="flood"}'
        assert cluster.metric("p0", evictions) == 3 * PROMPT_BLOCKS - SHARE_BLOCKS
        assert cluster.metric("p0", 'pdserve_kv_store_tenant_evictions_total{tenant="quiet"}') == 0
        assert cluster.metric("p0", 'pdserve_kv_store_tenant_bytes{tenant="flood"}') == SHARE_BLOCKS * value
        assert cluster.metric("p0", 'pdserve_kv_store_tenant_share_bytes{tenant="quiet"}') == SHARE_BLOCKS * value

        assert accounts_exact(store, *names) == full
        assert {name: b["free"] for name, b in cluster.blocks().items()} == {"p0": P_BLOCKS, "d0": D_BLOCKS}
    finally:
        if tenants is not None:
            tenants.close()
        if cluster is not None:
            cluster.stop()
        store.stop()
