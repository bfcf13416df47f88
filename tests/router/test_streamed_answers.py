"""The router's streamed answers (router/app.py, `respond`) over real HTTP, against stub servers
(bench/micro/stubs.py): every chunk arrives whole and in order for the official openai SDK, and a
client that leaves is aborted on both servers at once, even while no token comes (and one that leaves
before a whole answer, too)."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from bench.micro.stub_cluster import StubCluster
from bench.micro.stubs import STUB_TOKENS
from tests.router.test_router_load import aborted_on_both
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TOKENS = 40


def stub_text(folder, n: int) -> list[str]:
    """The stub decode server's first ``n`` tokens, each as the text it decodes to."""
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    return [tokenizer.decode([STUB_TOKENS[i % len(STUB_TOKENS)]]) for i in range(n)]


@pytest.mark.parametrize("token_delay", [0.0, 0.002], ids=["tokens-together", "token-by-token"])
def test_the_sdk_reads_every_chunk_whole_and_in_order(tmp_path, token_delay):
    with StubCluster(tmp_path, token_delay=token_delay) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="none", max_retries=0, timeout=30)
        for _ in range(3):  # on a kept-alive connection: each stream ends where it should
            stream = client.completions.create(
                model="stub",
                prompt="hello there",
                max_tokens=TOKENS,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            chunks = list(stream)
            assert [c.choices[0].text for c in chunks] == stub_text(tmp_path, TOKENS)
            assert [c.choices[0].finish_reason for c in chunks] == [None] * (TOKENS - 1) + ["length"]
            assert len({c.id for c in chunks}) == 1
        decode = cluster.stats("decode")
    assert (decode["requests"], decode["aborts"], decode["open_streams"]) == (3, 0, 0)


def test_a_client_that_leaves_while_no_token_comes_is_aborted_on_both_servers_at_once(tmp_path):
    # A token every 120 s, and the router's stall limit further off: only the closed connection can
    # tell the router that the client left (no write fails, nothing times out).
    with StubCluster(tmp_path, router={"stream_stall_s": 600.0}, token_delay=120.0) as cluster:
        body = {"model": "stub", "prompt": "hello there", "max_tokens": 8, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=cluster.router_url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                wait_until(lambda: cluster.stats("decode")["open_streams"] == 1, 30.0, "the decode stream open")
        aborted_on_both(cluster)


def test_a_client_that_leaves_before_a_whole_answer_is_aborted_on_both_servers(tmp_path):
    """The same for an answer that is not streamed: the router notices the closed connection while it
    waits for the tokens (router/app.py, ``until_disconnect``) and aborts the request on both servers."""
    with StubCluster(tmp_path, router={"stream_stall_s": 600.0}, token_delay=120.0) as cluster:
        body = json.dumps({"model": "stub", "prompt": "hello there", "max_tokens": 8, "ignore_eos": True}).encode()
        host, port = cluster.router_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_until(lambda: cluster.stats("decode")["open_streams"] == 1, 30.0, "the decode stream open")
        aborted_on_both(cluster)
