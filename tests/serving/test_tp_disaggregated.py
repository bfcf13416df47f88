"""A prefill server split over two ranks feeding a one-rank decode server, through the router with
the openai SDK, over ZeroMQ and NIXL: each prefill rank sends its own KV head from its own process
straight into the decode server's blocks; the tokens equal transformers' greedy ones in float32,
every request took the remote-KV path, and every block is free on both servers afterwards."""

from __future__ import annotations

import pytest

from tests.engine.oracle import hf_greedy
from tests.serving.conftest import start_cluster
from tests.serving.oracle import chat_prompt_ids, tokenizer
from tests.serving.test_tensor_parallel_cluster import ranks_of
from tests.transfer.conftest import nixl_available
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

BACKENDS = [pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed")), "zmq"]
REMOTE = 'pdserve_request_paths_total{path="remote_kv"}'
CONVERSATIONS = [
    [{"role": "user", "content": "Name three colours and say why the sky is blue."}],
    [{"role": "user", "content": "Count from one to twenty in words, please, slowly and carefully."}],
    [{"role": "user", "content": "Write a haiku about a prefill server that talks to a decode server."}],
]


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, tmp_path_factory, tiny_model):
    c = start_cluster(
        tmp_path_factory,
        "tiny-1p1d",
        tiny_model,
        {
            "max_model_len": 1024,
            "transfer": {"backend": request.param},
            "engine": {"prefix_caching": False},
            "prefill": [{"name": "p0", "port": 0, "block_size": 4, "tensor_parallel_size": 2}],
        },
    )
    wait_until(
        lambda: all(w["healthy"] for w in c.http.get(f"{c.router_url}/health").json()["workers"]),
        60,
        "both servers in the router's rotation",
    )
    yield c
    c.stop()


def test_two_prefill_ranks_into_one_decode_rank_answer_as_transformers(cluster, tiny_model):
    assert len(ranks_of(cluster.server("p0")["pid"])) == 1  # rank 1; rank 0 is the server itself
    assert len(ranks_of(cluster.server("d0")["pid"])) == 0
    client = cluster.client()
    before = cluster.metric("d0", REMOTE)
    for messages in CONVERSATIONS:
        want = hf_greedy(tiny_model, chat_prompt_ids(tiny_model, messages), 8, ignore_eos=True)
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            n=2,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
        assert [[x.token for x in choice.logprobs.content] for choice in r.choices] == [texts(tiny_model, want)] * 2
    assert cluster.metric("d0", REMOTE) == before + len(CONVERSATIONS)
    cluster.wait_idle(timeout=10)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values())


def texts(path: str, ids: list[int]) -> list[str]:
    tok = tokenizer(path)
    return [tok.decode([i]) for i in ids]
