"""1P1D through the router with the openai SDK: greedy answers equal transformers,
streamed and not, concurrent, conditional disaggregation, disconnects."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.cluster import MAX_MODEL_LEN, THRESHOLD
from tests.support.oracle import PROMPTS, chat_prompt_ids, expected_chat, expected_completion, tokenizer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(one_p_one_d):
    return one_p_one_d


def test_prefill_and_decode_block_sizes_differ(served):
    assert [s["role"] for s in served.servers] == ["prefill", "decode"]
    cfg = served.run_dir / "tiny-1p1d.yaml"
    assert "block_size: 4" in cfg.read_text() and "block_size: 16" in cfg.read_text()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_greedy_equal_transformers(served, tiny_model, stream):
    client = served.client()
    prefilled_before = served.metric("p0", 'pdserve_requests_total{outcome="ok"}')
    counters = {
        (name, kind): served.metric(name, f'pdserve_engine_tokens_total{{kind="{kind}"}}')
        for name in ("p0", "d0")
        for kind in ("prompt", "decode")
    }
    for prompt in PROMPTS:
        text, count = expected_completion(tiny_model, prompt, 24)
        if stream:
            chunks = list(
                client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            usage = chunks[-1].usage
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            got, usage, finish = r.choices[0].text, r.usage, r.choices[0].finish_reason
        assert got == text
        assert usage.completion_tokens == count
        assert usage.prompt_tokens == len(tokenizer(tiny_model)(prompt)["input_ids"])
        assert finish == ("length" if count == 24 else "stop")
    assert served.metric("p0", 'pdserve_requests_total{outcome="ok"}') == prefilled_before + len(PROMPTS)
    # Every prompt token computed once, on P; D only decodes.
    grew = {
        key: served.metric(key[0], f'pdserve_engine_tokens_total{{kind="{key[1]}"}}') - v for key, v in counters.items()
    }
    prompt_tokens = sum(len(tokenizer(tiny_model)(p)["input_ids"]) for p in PROMPTS)
    assert (
        grew
        == {
            ("p0", "prompt"): prompt_tokens,
            ("p0", "decode"): 0,
            ("d0", "prompt"): 0,
            ("d0", "decode"): grew[("d0", "decode")],
        }
        and grew[("d0", "decode")] > 0
    )
    assert served.metric("d0", "pdserve_preemptions_total") == 0
    assert served.metric("d0", 'pdserve_engine_steps_total{kind="decode"}') > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_greedy_equal_transformers(served, tiny_model, stream):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France? Numbers: 1 2 3."},
    ]
    text, count = expected_chat(tiny_model, messages, 20)
    client = served.client()
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=messages, max_completion_tokens=20, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    else:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
        got = r.choices[0].message.content
        assert r.usage.prompt_tokens == len(chat_prompt_ids(tiny_model, messages))
        assert r.usage.completion_tokens == count
    assert got == text


def test_sixteen_concurrent_requests_are_all_correct(served, tiny_model):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} Request number {i}." for i in range(16)]
    expected = [expected_completion(tiny_model, p, 16)[0] for p in prompts]

    async def run():
        client = served.async_client()
        calls = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0) for p in prompts]
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    assert [r.choices[0].text for r in results] == expected


def test_short_prompts_are_prefilled_on_the_decode_server(served, tiny_model):
    prompt = "Hello"
    assert len(tokenizer(tiny_model)(prompt)["input_ids"]) < THRESHOLD
    local_before = served.metric("d0", 'pdserve_request_paths_total{path="local_prefill"}')
    prefilled_before = served.metric("p0", 'pdserve_requests_total{outcome="ok"}')
    r = served.client().completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == expected_completion(tiny_model, prompt, 16)[0]
    assert served.metric("d0", 'pdserve_request_paths_total{path="local_prefill"}') == local_before + 1
    assert served.metric("p0", 'pdserve_requests_total{outcome="ok"}') == prefilled_before


def test_stop_string_ends_the_answer_before_it(served, tiny_model):
    prompt = PROMPTS[0]
    text, _ = expected_completion(tiny_model, prompt, 24)
    stop = text[5:8]
    r = served.client().completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_client_disconnect_mid_stream_frees_blocks_on_both_servers_within_a_second(served):
    # The decode server waits 5 ms after every step (server_common.faults), so the 900-token answer is still
    # decoding when the client leaves, however fast the engine runs the tiny model or slow the router is.
    faults = f"{served.server('d0')['url']}/admin/faults"
    body = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    aborted = served.metric("d0", 'pdserve_requests_total{outcome="aborted"}')
    served.http.post(faults, json={"step_delay_s": 0.005}).raise_for_status()  # with the internal secret
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{served.router_url}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                events = (line for line in resp.iter_lines() if line)
                for _ in range(5):
                    assert next(events).startswith("data: ")
                held = served.blocks()["d0"]
                assert held["running"] > 0
        left = time.monotonic()
        served.wait_idle(timeout=1.0)
        assert time.monotonic() - left < 1.0
    finally:
        served.http.post(faults, json={"step_delay_s": 0.0}).raise_for_status()
    assert served.metric("d0", 'pdserve_requests_total{outcome="aborted"}') == aborted + 1


def test_models_lists_the_tiny_model_with_its_folder(served, tiny_model):
    models = served.client().models.list().data
    assert [(m.id, m.root) for m in models] == [("tiny", tiny_model)]
    assert models[0].max_model_len == MAX_MODEL_LEN


def test_client_giving_up_on_a_whole_answer_frees_its_blocks(served):
    # The decode server waits 5 ms after every step (server_common.faults), so the 900-token answer takes
    # seconds however fast the engine decodes the tiny model: the client gives up with it in flight.
    faults = f"{served.server('d0')['url']}/admin/faults"
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as http:
        served.http.post(faults, json={"step_delay_s": 0.005}).raise_for_status()  # with the internal secret
        try:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{served.router_url}/v1/completions", json=body)
            served.wait_idle(timeout=1.5)
        finally:
            served.http.post(faults, json={"step_delay_s": 0.0}).raise_for_status()


def test_seeded_sampling_across_prefill_and_decode_equals_the_engine_alone(served, tiny_model):
    from engine import EngineConfig, LLMEngine, SamplingParams

    prompt = PROMPTS[3]
    params = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    engine = LLMEngine(EngineConfig(model=tiny_model, num_blocks=64, num_threads=1))
    (offline,) = engine.generate([prompt], SamplingParams(**params))
    client = served.client()
    answers = [
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, extra_body={"top_k": 50}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert answers == [offline.text, offline.text]
