"""A colocated server of tiny-swa (Gemma 3's shape: window layers of 8 tokens beside a global one) with
``engine.window_kv_blocks``, through the router with the openai SDK: the window layers keep their blocks
apart (engine/window_pool.py), the greedy answers and log-probabilities stay transformers' on prompts many
windows long, the server's KV blocks are the full layer's (what the router budgets requests with), and
every block is free after."""

from __future__ import annotations

import pytest

from engine.make_model import TINY_SWA, make_tiny
from tests.cluster.test_model_families_cluster import answers_and_logprobs_equal_transformers
from tests.support.cluster import start_cluster
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

WINDOW_BLOCKS = 160  # of 16 tokens; at least ceil((8 - 1 + 2048) / 16) + 1 = 130 (one step's largest chunk)
LAYER_BLOCK = 16 * 256  # one layer's K and V of 16 tokens: 2 KV heads of 16, float32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(make_tiny(tmp_path_factory.mktemp("tiny-swa"), TINY_SWA))
    c = start_cluster(tmp_path_factory, "colocated", model, {"engine": {"window_kv_blocks": WINDOW_BLOCKS}})
    wait_until(
        lambda: all(w["healthy"] for w in c.http.get(f"{c.router_url}/health").json()["workers"]),
        60,
        "the colocated server in the router's rotation",
    )
    yield c, model
    c.stop()


def test_answers_and_logprobs_equal_transformers_with_the_window_layers_apart(cluster):
    c, model = cluster
    long = "Zebras graze while the kettle sings: " + " ".join(str(i * 7) for i in range(30))
    answers_and_logprobs_equal_transformers(c, model, ("Hello, world! How are you today?", long))
    c.wait_idle(timeout=10)
    # 16 MiB less the window pool's 160 blocks of 3 layers, in blocks of the one full layer
    assert c.blocks()["c0"]["total"] == ((16 << 20) - WINDOW_BLOCKS * 3 * LAYER_BLOCK) // LAYER_BLOCK == 3616
    assert all(b["free"] == b["total"] for b in c.blocks().values())
