"""Prefix caching through a real 1P1D cluster (P blocks of 4, D blocks of 16, HND on D):
a prompt sharing a long prefix with an earlier one moves only the blocks D lacks,
P computes only what it does not hold itself, D prefills a prompt it holds but the
last token of, and the greedy tokens still equal transformers."""

from __future__ import annotations

import pytest

from tests.engine.oracle import hf_greedy
from tests.support.cluster import MAX_MODEL_LEN, THRESHOLD, start_cluster
from tests.support.oracle import tokenizer

pytestmark = pytest.mark.integration

A = [(29 * i) % 400 + 40 for i in range(150)]
B = A[:100] + [(31 * i) % 400 + 41 for i in range(40)]  # shares 100 tokens with A: 6 of D's blocks of 16
C = A[:129]  # D holds A's first 128 tokens: only the last one is missing


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    c = start_cluster(
        tmp_path_factory,
        "tiny-1p1d",
        tiny_model,
        {"max_model_len": MAX_MODEL_LEN, "router": {"local_prefill_threshold": THRESHOLD}},
    )
    yield c
    c.stop()


def test_a_shared_prefix_moves_fewer_bytes_computes_less_and_stays_exact(served, tiny_model):
    client = served.client()
    names = {
        "bytes": ("p0", "pdserve_transfer_bytes_total"),
        "p_prompt": ("p0", 'pdserve_engine_tokens_total{kind="prompt"}'),
        "p_hits": ("p0", "pdserve_prefix_cache_hits_tokens_total"),
        "p_prefilled": ("p0", 'pdserve_requests_total{outcome="ok"}'),
        "d_prompt": ("d0", 'pdserve_engine_tokens_total{kind="prompt"}'),
        "d_hits": ("d0", "pdserve_prefix_cache_hits_tokens_total"),
        "d_local": ("d0", 'pdserve_request_paths_total{path="local_prefill"}'),
    }

    def snapshot() -> dict[str, float]:
        return {key: served.metric(*where) for key, where in names.items()}

    def complete(prompt: list[int]) -> tuple[dict[str, float], int]:
        before = snapshot()
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        ids = hf_greedy(tiny_model, prompt, 8)
        assert r.choices[0].text == tokenizer(tiny_model).decode(ids, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(ids)
        served.wait_idle(3.0)
        after = snapshot()
        return {k: after[k] - before[k] for k in names}, r.usage.prompt_tokens_details.cached_tokens

    grew, cached = complete(A)
    assert cached == 0 and grew["d_hits"] == grew["p_hits"] == 0
    assert grew["p_prompt"] == 150 and grew["d_prompt"] == 0
    per_token = grew["bytes"] / 150

    grew, cached = complete(B)
    assert cached == grew["d_hits"] == 96  # D: 6 whole blocks of 16
    assert grew["bytes"] == (140 - 96) * per_token  # only the blocks D lacks went over the wire
    assert (grew["p_hits"], grew["p_prompt"]) == (100, 40)  # P: 25 whole blocks of 4 of its own
    assert grew["d_prompt"] == 0

    grew, cached = complete(C)
    assert cached == 128 and grew["d_local"] == 1 and grew["d_prompt"] == 1
    assert grew["bytes"] == grew["p_prefilled"] == grew["p_prompt"] == 0
