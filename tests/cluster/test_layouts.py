"""2P1D, 1P2D, 1P1D over NIXL, and colocated clusters: greedy answers equal transformers."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.cluster import start_cluster
from tests.support.oracle import PROMPTS, expected_chat, expected_completion

pytestmark = pytest.mark.integration

PREFILLED = 'pdserve_requests_total{outcome="ok"}'  # on a prefill server
RESERVED = 'pdserve_request_paths_total{path="remote_kv"}'
LOCAL = 'pdserve_request_paths_total{path="local_prefill"}'
# layout -> (config, overrides, the servers the work must spread over, their counter)
LAYOUTS = {
    "2p1d": ("2p1d", {}, ("p0", "p1"), PREFILLED),  # prefill block sizes 16 and 8, decode 32
    "1p2d": ("1p2d", {}, ("d0", "d1"), RESERVED),  # prefill 16, decode block sizes 32 and 8
    "1p1d-nixl": ("tiny-1p1d", {"transfer": {"backend": "nixl"}}, ("p0",), PREFILLED),  # block sizes 4 and 16
    "colocated": ("colocated", {}, ("c0",), LOCAL),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, tmp_path_factory, tiny_model):
    template, changes, servers, counter = LAYOUTS[request.param]
    c = start_cluster(tmp_path_factory, template, tiny_model, changes)
    c.spread = servers, counter
    yield c
    c.stop()


def test_concurrent_greedy_answers_equal_transformers_on_every_server(served, tiny_model):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(8)]
    expected = [expected_completion(tiny_model, p, 12)[0] for p in prompts]

    async def run():
        client = served.async_client()
        return await asyncio.gather(
            *(client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0) for p in prompts)
        )

    assert [r.choices[0].text for r in asyncio.run(run())] == expected
    servers, counter = served.spread
    for name in servers:  # the policy spread the work over every server of the role
        assert served.metric(name, counter) >= 1, name


def test_streamed_chat_equals_transformers(served, tiny_model):
    messages = [{"role": "user", "content": "Hello, world! How are you today?"}]
    text, _ = expected_chat(tiny_model, messages, 16)
    chunks = served.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
