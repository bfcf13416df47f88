"""2P1D, 1P2D and colocated clusters: greedy answers equal transformers."""

from __future__ import annotations

import asyncio

import pytest

from tests.serving.conftest import start_cluster
from tests.serving.oracle import PROMPTS, expected_chat, expected_completion

pytestmark = pytest.mark.integration

LAYOUTS = {
    "2p1d": ("p0", "p1"),  # prefill block sizes 16 and 8, decode 32
    "1p2d": ("d0", "d1"),  # prefill 16, decode block sizes 32 and 8
    "colocated": ("c0",),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, tmp_path_factory, tiny_model):
    c = start_cluster(tmp_path_factory, request.param, tiny_model)
    c.layout = request.param
    yield c
    c.stop()


def test_concurrent_greedy_answers_equal_transformers_on_every_server(served, tiny_model):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(8)]
    expected = [expected_completion(tiny_model, p, 12)[0] for p in prompts]

    async def run():
        client = served.async_client()
        return await asyncio.gather(*(client.completions.create(model="tiny", prompt=p, max_tokens=12,
                                                                temperature=0) for p in prompts))

    assert [r.choices[0].text for r in asyncio.run(run())] == expected
    role = {"2p1d": "prefilled", "1p2d": "reserved", "colocated": "local_prefill"}[served.layout]
    for name in LAYOUTS[served.layout]:  # the policy spread the work over every server of the role
        assert served.metric(name, f'pdserve_requests_total{{outcome="{role}"}}') >= 1, name


def test_streamed_chat_equals_transformers(served, tiny_model):
    messages = [{"role": "user", "content": "Hello, world! How are you today?"}]
    text, _ = expected_chat(tiny_model, messages, 16)
    chunks = served.client().chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                     stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
