"""Clusters of mock engines (engine.kind: mock, engine/mock.py): real servers, router and KV protocol
over a model folder without weights; the tokens are the mock engine's own, and every block comes back."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from bench.plan.costmodel import StepCost
from bench.plan.profile import Profile
from engine.config import EngineConfig
from engine.mock import MockEngine
from engine.request import SamplingParams
from tests.support.cluster import MAX_MODEL_LEN, THRESHOLD, Cluster, make_config
from tests.support.oracle import PROMPTS, chat_prompt_ids, tokenizer

pytestmark = pytest.mark.integration

MOCK = {"engine": {"kind": "mock", "prefix_caching": False}, "max_model_len": MAX_MODEL_LEN}
STEP_S = 0.01  # every step of the module's cluster, whatever it computes (its profile)


def weightless(model: str, folder: Path) -> str:
    """The model folder without its weights: config, generation config and tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in Path(model).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    return str(folder)


def expected(model: str, prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
    """(text, tokens) the mock engine gives this prompt, in this process."""
    engine = MockEngine(EngineConfig(model=model, kind="mock", max_model_len=MAX_MODEL_LEN))
    ids = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].token_ids
    return tokenizer(model).decode(ids, skip_special_tokens=True), len(ids)


def start(tmp_path_factory, model: str, changes: dict) -> Cluster:
    folder = tmp_path_factory.mktemp("mock")
    return Cluster(make_config(folder, "tiny-1p1d", model, changes), folder)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model) -> str:
    return weightless(tiny_model, tmp_path_factory.mktemp("weightless") / "tiny")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model):
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    steps = {1: StepCost(STEP_S, 0, 0, 0, 0)}  # num_threads 1 (tests/support/cluster.py)
    Profile("tiny", "float32", "cpu", 2, 64, steps, {1: 0.0}, 1e9, 1e-4, "test").save(profile)
    engine = {**MOCK["engine"], "mock_profile": str(profile)}
    c = start(tmp_path_factory, model, {**MOCK, "engine": engine, "router": {"local_prefill_threshold": THRESHOLD}})
    yield c
    c.stop()


def test_chat_through_prefill_and_decode_gives_the_mock_tokens(served, model):
    client = served.client()
    prefilled = served.metric("p0", 'pdserve_requests_total{outcome="ok"}')
    sent = served.metric("p0", "pdserve_transfer_bytes_total")
    prompt_tokens = 0
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text, count = expected(model, chat_prompt_ids(model, messages), 24)
        answers = [
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
            for _ in range(2)
        ]
        assert count == 24
        assert [(a.choices[0].message.content, a.usage.completion_tokens) for a in answers] == [(text, 24)] * 2
        assert {a.choices[0].finish_reason for a in answers} == {"length"}
        prompt_tokens += sum(a.usage.prompt_tokens for a in answers)
    assert served.metric("p0", 'pdserve_requests_total{outcome="ok"}') == prefilled + 2 * len(PROMPTS)
    # the mock cache's K and V of a token: one float32 each, all that crosses to d0
    assert served.metric("p0", "pdserve_transfer_bytes_total") - sent == 8 * prompt_tokens
    served.wait_idle(3.0)
    assert all(b["free"] == b["total"] for b in served.blocks().values())


def test_a_decode_server_steps_at_the_profiles_pace(served):
    """60 tokens of a short prompt (prefilled on d0) take about 60 modelled steps, on the wall and in d0's
    own step counters."""
    steps = 'pdserve_engine_steps_total{kind="decode"}'
    seconds = 'pdserve_engine_step_seconds_total{kind="decode"}'
    before = served.metric("d0", steps), served.metric("d0", seconds)
    start = time.monotonic()
    r = served.client().completions.create(model="tiny", prompt="Hi", max_tokens=60, temperature=0)
    elapsed = time.monotonic() - start
    assert r.usage.completion_tokens == 60
    assert 60 * STEP_S <= elapsed < 60 * STEP_S * 2 + 1.0
    count, spent = served.metric("d0", steps) - before[0], served.metric("d0", seconds) - before[1]
    assert count == 59  # the first token came with the prompt's step
    assert STEP_S <= spent / count < STEP_S * 2


def test_streamed_completions_count_every_token(served, model):
    client = served.client()
    prompt = PROMPTS[1]
    text, _ = expected(model, tokenizer(model)(prompt)["input_ids"], 40)
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 40
    served.wait_idle(3.0)
    assert all(b["free"] == b["total"] for b in served.blocks().values())


def test_a_structured_request_is_refused_and_frees_everything(served):
    r = served.http.post(
        f"{served.router_url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 4,
            "response_format": {"type": "json_object"},
        },
    )
    # the decode server's 400, passed on as the router passes on any worker's refusal it did not foresee
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_request" and "a mock engine does not follow structured outputs" in error["message"]
    served.wait_idle(3.0)
    assert all(b["free"] == b["total"] for b in served.blocks().values())


def test_a_colocated_mock_cluster_gives_the_same_tokens(tmp_path_factory, model):
    changes = {**MOCK, "prefill": [], "decode": [], "colocated": [{"name": "c0", "port": 1}]}
    c = start(tmp_path_factory, model, changes)
    try:
        messages = [{"role": "user", "content": PROMPTS[0]}]
        text, _ = expected(model, chat_prompt_ids(model, messages), 16)
        r = c.client().chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
        assert (r.choices[0].message.content, r.usage.completion_tokens) == (text, 16)
        c.wait_idle(3.0)
        assert all(b["free"] == b["total"] for b in c.blocks().values())
    finally:
        c.stop()


@pytest.mark.slow
def test_eight_prefill_and_eight_decode_mock_servers_serve_a_load(tmp_path_factory, model):
    """16 mock servers and a router on these cores: 96 requests, 16 at a time, no error, every block back."""
    prefill = [{"name": f"p{i}", "port": 1, "block_size": 4} for i in range(8)]
    decode = [{"name": f"d{i}", "port": 1, "block_size": 16} for i in range(8)]
    changes = {
        **MOCK,
        "engine": {**MOCK["engine"], "num_blocks": 256},
        "router": {"local_prefill_threshold": THRESHOLD, "policy": "least_loaded"},
        "prefill": prefill,
        "decode": decode,
    }
    c = start(tmp_path_factory, model, changes)
    try:
        client = c.async_client()

        async def one(i: int) -> int:
            prompt = f"request {i}: " + PROMPTS[i % len(PROMPTS)]
            r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            return r.usage.completion_tokens

        async def load() -> list[int | BaseException]:
            gate = asyncio.Semaphore(16)

            async def gated(i: int) -> int:
                async with gate:
                    return await one(i)

            try:
                return await asyncio.gather(*(gated(i) for i in range(96)), return_exceptions=True)
            finally:
                await client.close()

        results = asyncio.run(load())
        assert [r for r in results if not isinstance(r, int)] == []
        assert results == [12] * 96
        served = {s["name"]: c.metric(s["name"], 'pdserve_requests_total{outcome="ok"}') for s in c.servers}
        assert sum(served[p["name"]] for p in prefill) == 96  # every prompt is past the threshold
        assert sum(1 for d in decode if served[d["name"]] > 0) >= 4  # the load spread over the decode servers
        c.wait_idle(5.0)
        assert all(b["free"] == b["total"] for b in c.blocks().values())
    finally:
        c.stop()
