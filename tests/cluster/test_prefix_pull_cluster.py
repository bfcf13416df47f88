"""Decode-to-prefill reuse through a real 1P1D cluster (P blocks of 4 NHD, D blocks of 16 HND), no shared
store: the second turn of a conversation is reserved on d0, which holds the first turn's prompt and answer;
p0 holds only the first prompt, reads the rest of d0's pinned prefix back (POST /kv/read under the
reservation's transfer id, checksummed), computes only the tokens after it, and the greedy tokens equal
transformers'. A read whose bytes were corrupted on the way is a miss, counted: p0 computes the prefix, the
answer is the same. That cluster reads whatever a read costs (``pull_prefix_margin: 0``); a second one, whose
margin no read of the tiny model can meet, skips the read as not worth it and computes the prefix. Blocks are
all back on both servers after every scenario."""

from __future__ import annotations

import pytest

from tests.engine.oracle import hf_greedy
from tests.support.cluster import MAX_MODEL_LEN, THRESHOLD, Cluster, start_cluster
from tests.support.oracle import tokenizer

pytestmark = pytest.mark.integration

ANSWER = 40  # turn 1's answer: d0 then holds 60 + 39 tokens' K/V, 6 whole blocks of 16 and a kept tail of 3
PULLS = "pdserve_kv_prefix_pulls_total"


def turn1(k: int) -> list[int]:
    return [(29 * i + 53 * k) % 400 + 40 for i in range(60)]


def new_tokens(k: int) -> list[int]:
    return [(7 * i + 11 * k) % 300 + 60 for i in range(20)]


def pulling(tmp_path_factory, tiny_model, margin: float, **settings):
    """tiny-1p1d with the pull on, a read asked for when computing its tokens is estimated to take ``margin``
    times as long as reading them (prefill_server/pull_rule.py); started for a module, stopped after it."""
    config = {
        "max_model_len": MAX_MODEL_LEN,
        "router": {"local_prefill_threshold": THRESHOLD},
        "transfer": {"pull_prefix": True, "pull_prefix_margin": margin},
        **settings,
    }
    c = start_cluster(tmp_path_factory, "tiny-1p1d", tiny_model, config)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    yield from pulling(tmp_path_factory, tiny_model, 0, fault_injection=True)  # read whatever it costs


@pytest.fixture(scope="module")
def weighing(tmp_path_factory, tiny_model):
    """A read only where computing its tokens would take a million times as long: never, once p0 computed."""
    yield from pulling(tmp_path_factory, tiny_model, 1e6)


def complete(cluster: Cluster, model: str, tokens: list[int]) -> list[int]:
    """One greedy completion of ANSWER tokens through the router, checked against transformers; its ids."""
    body = {"ignore_eos": True}
    r = cluster.client().completions.create(
        model="tiny", prompt=tokens, max_tokens=ANSWER, temperature=0, extra_body=body
    )
    ids = hf_greedy(model, tokens, ANSWER, ignore_eos=True)
    assert r.choices[0].text == tokenizer(model).decode(ids, skip_special_tokens=True)
    cluster.wait_idle(3.0)
    return ids


def counts(cluster: Cluster) -> dict[str, float]:
    names = {
        "p_prompt": ("p0", 'pdserve_engine_tokens_total{kind="prompt"}'),
        "pulled": ("p0", "pdserve_kv_prefix_pulled_tokens_total"),
        "pulls_ok": ("p0", f'{PULLS}{{outcome="ok"}}'),
        "pulls_bad": ("p0", f'{PULLS}{{outcome="checksum_mismatch"}}'),
        "pulls_skipped": ("p0", f'{PULLS}{{outcome="not_worth_it"}}'),
        "reads_ok": ("d0", 'pdserve_kv_prefix_reads_total{outcome="ok"}'),
        "d_hits": ("d0", "pdserve_prefix_cache_hits_tokens_total"),
    }
    return {key: cluster.metric(*where) for key, where in names.items()}


def all_back(cluster: Cluster) -> None:
    blocks = cluster.blocks()
    assert all(b["free"] == b["total"] for b in blocks.values()), blocks


def test_the_next_turn_reads_the_answer_from_the_decode_server_and_computes_only_new_tokens(served, tiny_model):
    first = turn1(0)
    answer = complete(served, tiny_model, first)
    before = counts(served)
    second = first + answer + new_tokens(0)  # 120 tokens: d0 holds 99, p0 its own 60 (15 blocks of 4)
    complete(served, tiny_model, second)
    grew = {k: v - before[k] for k, v in counts(served).items()}
    assert grew["d_hits"] == 99  # 6 blocks and the tail of the 7th (engine/block_manager.py, keep_tail)
    assert grew["pulls_ok"] == grew["reads_ok"] == 1
    assert grew["pulled"] == 99 - 60  # 9 blocks of 4 read from d0, and the 3 tokens of a tenth: p0 keeps a tail
    assert grew["p_prompt"] == len(second) - 99  # only the tokens d0 did not hold
    all_back(served)


def test_a_corrupted_read_is_a_miss_and_the_prefix_is_computed(served, tiny_model):
    first = turn1(1)
    answer = complete(served, tiny_model, first)
    faults = f"{served.server('d0')['url']}/admin/faults"
    served.http.post(faults, json={"corrupt_reads": 1}).raise_for_status()
    before = counts(served)
    second = first + answer + new_tokens(1)
    complete(served, tiny_model, second)
    grew = {k: v - before[k] for k, v in counts(served).items()}
    assert served.http.get(faults).json()["injected"]["reads_corrupted"] == 1
    assert grew["pulls_bad"] == grew["reads_ok"] == 1 and grew["pulls_ok"] == grew["pulled"] == 0
    assert grew["p_prompt"] == len(second) - 60  # p0 computed past its own 60 tokens
    all_back(served)


def test_a_read_for_no_waiting_reservation_is_refused(served):
    url = f"{served.server('d0')['url']}/kv/read"
    r = served.http.post(url, json={"transfer_id": "none-such", "start": 0, "end": 16})
    assert r.status_code == 409 and r.json()["code"] == "stale_reservation"
    all_back(served)


def test_a_read_estimated_slower_than_computing_is_skipped_and_the_prefix_is_computed(weighing, tiny_model):
    first = turn1(2)
    answer = complete(weighing, tiny_model, first)  # p0 computes these 60 tokens: its throughput is known
    before = counts(weighing)
    second = first + answer + new_tokens(2)
    complete(weighing, tiny_model, second)
    grew = {k: v - before[k] for k, v in counts(weighing).items()}
    assert grew["d_hits"] == 99
    assert grew["pulls_skipped"] == 1 and grew["pulls_ok"] == grew["reads_ok"] == grew["pulled"] == 0
    assert grew["p_prompt"] == len(second) - 60  # p0 computed the 39 tokens d0 held past its own 60
    assert weighing.metric("p0", "pdserve_kv_prefix_compute_tokens_per_second") > 0  # learned from turn 1
    all_back(weighing)
