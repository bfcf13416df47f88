"""Prefill and decode servers of different tensor-parallel sizes, through the router with the openai
SDK, over ZeroMQ and NIXL: (one prefill server feeding two decode servers in turn) P TP 2 -> D TP 1
and P TP 2 -> D TP 4, and (one decode server fed by two prefill servers in turn) P TP 1 -> D TP 2
and P TP 2 -> D TP 2, with other block sizes and cache orders. Each prefill
rank sends its own KV heads from its own process straight into the decode ranks holding them; the
tokens equal transformers' greedy ones in float32 (their log-probabilities within 1e-4), every
request took the remote-KV path through every pair of servers, and every block is free on every
server afterwards."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.cluster.test_tensor_parallel_cluster import ranks_of
from tests.engine.oracle import hf_greedy, hf_logits
from tests.support.cluster import start_cluster
from tests.support.oracle import chat_prompt_ids, tokenizer
from tests.transfer.conftest import nixl_available
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl not installed")
TWO_TO_ONE_AND_FOUR = {  # tiny has 2 KV heads: D TP 4 holds each on two ranks
    "prefill": [{"name": "p0", "block_size": 4, "tensor_parallel_size": 2}],
    "decode": [
        {"name": "d0", "block_size": 16, "kv_layout": "HND"},
        {"name": "d1", "block_size": 8, "tensor_parallel_size": 4},
    ],
}
ONE_AND_TWO_TO_TWO = {
    "prefill": [
        {"name": "p0", "block_size": 4},
        {"name": "p1", "block_size": 8, "tensor_parallel_size": 2},
    ],
    "decode": [{"name": "d0", "block_size": 16, "kv_layout": "HND", "tensor_parallel_size": 2}],
}
SHAPES = [
    pytest.param(("zmq", TWO_TO_ONE_AND_FOUR), id="zmq-P2-D1,D4"),
    pytest.param(("nixl", TWO_TO_ONE_AND_FOUR), id="nixl-P2-D1,D4", marks=NIXL),
    pytest.param(("zmq", ONE_AND_TWO_TO_TWO), id="zmq-P1,P2-D2"),
    pytest.param(("nixl", ONE_AND_TWO_TO_TWO), id="nixl-P1,P2-D2", marks=NIXL),
]
REMOTE = 'pdserve_request_paths_total{path="remote_kv"}'
OK = 'pdserve_requests_total{outcome="ok"}'
CONVERSATIONS = [
    [{"role": "user", "content": "Name three colours and say why the sky is blue."}],
    [{"role": "user", "content": "Count from one to twenty in words, please, slowly and carefully."}],
    [{"role": "user", "content": "Write a haiku about a prefill server that talks to a decode server."}],
]


@pytest.fixture(scope="module", params=SHAPES)
def cluster(request, tmp_path_factory, tiny_model):
    backend, shape = request.param
    c = start_cluster(
        tmp_path_factory,
        "tiny-1p1d",
        tiny_model,
        {
            "max_model_len": 1024,
            "transfer": {"backend": backend},
            "engine": {"prefix_caching": False},
            "fault_injection": True,
            **shape,
        },
    )
    wait_until(
        lambda: all(w["healthy"] for w in c.http.get(f"{c.router_url}/health").json()["workers"]),
        60,
        "both servers in the router's rotation",
    )
    yield c, shape, backend
    c.stop()


def test_every_rank_pair_answers_as_transformers_with_every_block_free_after(cluster, tiny_model):
    cluster, shape, _ = cluster
    prefills = [i["name"] for i in shape["prefill"]]
    for instance in shape["prefill"] + shape["decode"]:  # rank 0 is the server itself
        size = instance.get("tensor_parallel_size", 1)
        assert len(ranks_of(cluster.server(instance["name"])["pid"])) == size - 1, instance["name"]
    decodes = [i["name"] for i in shape["decode"]]
    client = cluster.client()
    served = {name: cluster.metric(name, REMOTE if name in decodes else OK) for name in prefills + decodes}
    for messages in CONVERSATIONS:
        prompt = chat_prompt_ids(tiny_model, messages)
        want = hf_greedy(tiny_model, prompt, 8, ignore_eos=True)
        rows = torch.log_softmax(hf_logits(tiny_model, prompt + want), dim=-1)[len(prompt) - 1 :]
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
        for choice in r.choices:  # the first token's from the prefill ranks, the rest from the decode ranks
            for x, token, row in zip(choice.logprobs.content, want, rows):
                assert abs(x.logprob - row[token].item()) < 1e-4
    now = {name: cluster.metric(name, REMOTE if name in decodes else OK) for name in prefills + decodes}
    assert sum(now[d] - served[d] for d in decodes) == len(CONVERSATIONS)  # every request's KV came from P
    assert all(now[name] > served[name] for name in now), (served, now)  # every server took its turn
    cluster.wait_idle(timeout=10)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values())


def texts(path: str, ids: list[int]) -> list[str]:
    tok = tokenizer(path)
    return [tok.decode([i]) for i in ids]


def test_one_corrupted_rank_part_fails_the_whole_transfer_with_its_code_and_leaks_nothing(cluster, tiny_model):
    """Decode rank 0 of whichever decode server gets the request flips a byte of one write it
    receives: its part fails its checksum, the other parts are stopped, the request ends with
    checksum_mismatch (or the router's recovery answers it right), and every block on every server
    is free; the next request is exact again."""
    cluster, shape, backend = cluster
    if backend == "nixl":
        pytest.skip("corrupt_writes flips writes a ZeroMQ receiver takes in; NIXL's land one-sided, unseen")
    failed = 'pdserve_transfer_failures_total{outcome="checksum_mismatch"}'
    decodes = [cluster.server(i["name"])["url"] for i in shape["decode"]]
    before = sum(cluster.metric(i["name"], failed) for i in shape["decode"])
    for url in decodes:
        cluster.http.post(f"{url}/admin/faults", json={"corrupt_writes": 1}).raise_for_status()
    messages = CONVERSATIONS[0]
    want = texts(tiny_model, hf_greedy(tiny_model, chat_prompt_ids(tiny_model, messages), 8, ignore_eos=True))
    client = cluster.client()
    try:
        r = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
        )
    except openai.APIStatusError as exc:
        assert exc.body["code"] == "checksum_mismatch", exc.body
    else:
        assert [x.token for x in r.choices[0].logprobs.content] == want
    corrupted = [cluster.http.get(f"{url}/admin/faults").json()["injected"]["writes_corrupted"] for url in decodes]
    assert sum(corrupted) == 1
    assert sum(cluster.metric(i["name"], failed) for i in shape["decode"]) == before + 1
    for url in decodes:  # the decode server that got no write is still armed
        cluster.http.post(f"{url}/admin/faults", json={}).raise_for_status()
    cluster.wait_idle(timeout=10)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values())
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    assert [x.token for x in r.choices[0].logprobs.content] == want
    cluster.wait_idle(timeout=10)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values())
