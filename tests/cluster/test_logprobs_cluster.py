"""Log-probabilities, echo, n and prompt lists through the router with the openai SDK, on 1P1D
(P block size 4, D block size 16: the prefill server scores the prompt and the first tokens) and
on a colocated server, against one transformers float32 forward pass over the same tokens."""

from __future__ import annotations

import pytest
import torch

from tests.engine.oracle import hf_greedy, hf_logits, hf_processed_greedy
from tests.support.cluster import MAX_MODEL_LEN, THRESHOLD, start_cluster
from tests.support.oracle import chat_prompt_ids, tokenizer

pytestmark = pytest.mark.integration

TOL = 1e-4
PROMPT = "A prefill server computes the prompt; a decode server streams the answer one token at a time."
MESSAGES = [{"role": "user", "content": "Name three colours and say why the sky is blue."}]
TOP = 3


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def cluster(request, tmp_path_factory, tiny_model):
    if request.param == "1p1d":
        yield request.getfixturevalue("one_p_one_d")
        return
    c = start_cluster(
        tmp_path_factory,
        "colocated",
        tiny_model,
        {"max_model_len": MAX_MODEL_LEN, "engine": {"prefix_caching": False, "block_size": 8}},
    )
    yield c
    c.stop()


def scores(path: str, tokens: list[int]) -> torch.Tensor:
    """log-softmax [len(tokens), vocab]: row i is the distribution of token i + 1."""
    return torch.log_softmax(hf_logits(path, tokens), dim=-1)


def check_token(
    path: str,
    got_logprob: float,
    got_top: dict[str, float],
    row: torch.Tensor,
    token: int,
    top: int,
    with_chosen: bool = False,
) -> None:
    """The chosen token's log-probability and the top ones (with the chosen one: completions')."""
    tok = tokenizer(path)
    assert abs(got_logprob - row[token].item()) < TOL
    values, ids = row.topk(top)
    want = {tok.decode([i]): v for i, v in zip(ids.tolist(), values.tolist())}
    if with_chosen:
        want.setdefault(tok.decode([token]), row[token].item())
    assert set(got_top) == set(want), (got_top, want)
    for key, value in got_top.items():
        assert abs(value - want[key]) < TOL


def test_the_prompt_is_long_enough_to_be_prefilled_remotely_on_1p1d(served, tiny_model):
    assert len(tokenizer(tiny_model)(PROMPT)["input_ids"]) > THRESHOLD
    assert len(chat_prompt_ids(tiny_model, MESSAGES)) > THRESHOLD


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_equal_transformers(served, tiny_model, stream):
    prompt = chat_prompt_ids(tiny_model, MESSAGES)
    ids = hf_greedy(tiny_model, prompt, 8, ignore_eos=True)
    kw = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
        extra_body={"ignore_eos": True},
    )
    client = served.client()
    if stream:
        content = [
            x
            for ch in client.chat.completions.create(stream=True, **kw)
            if ch.choices and ch.choices[0].logprobs
            for x in ch.choices[0].logprobs.content
        ]
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    rows = scores(tiny_model, prompt + ids)
    tok = tokenizer(tiny_model)
    assert [x.token for x in content] == [tok.decode([i]) for i in ids]
    for k, (x, token) in enumerate(zip(content, ids)):
        assert x.bytes == list(x.token.encode())
        check_token(
            tiny_model, x.logprob, {t.token: t.logprob for t in x.top_logprobs}, rows[len(prompt) - 1 + k], token, TOP
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_echo_with_logprobs_scores_prompt_and_answer_as_transformers(served, tiny_model, stream):
    tok = tokenizer(tiny_model)
    prompt = tok(PROMPT)["input_ids"]
    ids = hf_greedy(tiny_model, prompt, 4, ignore_eos=True)
    kw = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=TOP,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    client = served.client()
    if stream:
        chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **kw) if ch.choices]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        token_lps = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs]
        tops = [t for c in chunks if c.logprobs for t in c.logprobs.top_logprobs]
    else:
        choice = client.completions.create(**kw).choices[0]
        text, lp = choice.text, choice.logprobs
        tokens, token_lps, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    everything = prompt + ids
    assert text == PROMPT + tok.decode(ids, skip_special_tokens=True)
    assert tokens == [tok.decode([i]) for i in everything]
    assert token_lps[0] is None and tops[0] is None
    rows = scores(tiny_model, everything)
    for k in range(1, len(everything)):
        check_token(tiny_model, token_lps[k], tops[k], rows[k - 1], everything[k], TOP, with_chosen=True)


def test_max_tokens_0_with_echo_scores_the_prompt_only(served, tiny_model):
    tok = tokenizer(tiny_model)
    prompt = tok(PROMPT)["input_ids"]
    r = served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    rows = scores(tiny_model, prompt)
    assert r.choices[0].text == PROMPT and r.usage.completion_tokens == 0
    lps = r.choices[0].logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(prompt)
    assert all(abs(lps[k] - rows[k - 1][prompt[k]].item()) < TOL for k in range(1, len(prompt)))


def test_prompt_logprobs_in_vllm_s_shape_equal_transformers(served, tiny_model):
    tok = tokenizer(tiny_model)
    prompt = tok(PROMPT)["input_ids"]
    r = served.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": TOP}
    )
    chat_prompt = chat_prompt_ids(tiny_model, MESSAGES)
    got = r.model_extra["prompt_logprobs"]
    c = served.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": TOP}
    )
    for ids, entries in ((chat_prompt, got), (prompt, c.choices[0].model_extra["prompt_logprobs"])):
        rows = scores(tiny_model, ids)
        assert entries[0] is None and len(entries) == len(ids)
        for k in range(1, len(ids)):
            values, top_ids = rows[k - 1].topk(TOP)
            want = {str(i): v for i, v in zip(top_ids.tolist(), values.tolist())}
            want[str(ids[k])] = rows[k - 1][ids[k]].item()
            assert set(entries[k]) == set(want)
            assert all(abs(entries[k][key]["logprob"] - want[key]) < TOL for key in want)


def test_n_greedy_sequences_all_equal_transformers(served, tiny_model):
    tok = tokenizer(tiny_model)
    ids = hf_greedy(tiny_model, tok(PROMPT)["input_ids"], 10)
    r = served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, n=4)
    want = tok.decode(ids, skip_special_tokens=True)
    assert [(c.index, c.text) for c in r.choices] == [(i, want) for i in range(4)]
    assert r.usage.completion_tokens == 4 * len(ids)
    assert r.usage.prompt_tokens == len(tok(PROMPT)["input_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_seeded_sequences_are_reproducible_and_equal_the_seeds_one_at_a_time(served, stream):
    client = served.client()
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})

    def texts(**more) -> list[str]:
        if not stream:
            return [c.text for c in client.completions.create(**kw, **more).choices]
        got: dict[int, str] = {}
        for ch in client.completions.create(stream=True, **kw, **more):
            for c in ch.choices:
                got[c.index] = got.get(c.index, "") + c.text
        return [got[i] for i in sorted(got)]

    together = texts(n=4, seed=11)
    assert together == texts(n=4, seed=11)
    assert together == [texts(seed=11 + i)[0] for i in range(4)]
    assert len(set(together)) > 1


def test_a_list_of_prompts_answers_each_as_alone(served, tiny_model):
    tok = tokenizer(tiny_model)
    prompts = [PROMPT, "Once upon a time there was a small model that wanted to serve many users at once"]
    r = served.client().completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2)
    want = [tok.decode(hf_greedy(tiny_model, tok(p)["input_ids"], 6), skip_special_tokens=True) for p in prompts]
    assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
    assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)


def test_every_block_is_free_again_on_every_server(served):
    served.wait_idle(3.0)
    assert all(b["free"] == b["total"] for b in served.blocks().values()), served.blocks()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_penalties_and_logit_bias_through_the_router_equal_the_reference_on_transformers(served, tiny_model, stream):
    from engine.request import SamplingParams

    tok = tokenizer(tiny_model)
    prompt = tok(PROMPT)["input_ids"]
    first = hf_greedy(tiny_model, prompt, 1, ignore_eos=True)[0]
    fields = {
        "presence_penalty": 0.7,
        "frequency_penalty": 0.4,
        "repetition_penalty": 1.3,
        "logit_bias": {str(first): -30.0, "17": 4.0},
        "min_tokens": 3,
        "ignore_eos": True,
    }
    params = SamplingParams(
        max_tokens=10,
        temperature=0,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias=((first, -30.0), (17, 4.0)),
        min_tokens=3,
        ignore_eos=True,
    )
    want, _ = hf_processed_greedy(tiny_model, prompt, params, (tok.eos_token_id,))
    assert want != hf_greedy(tiny_model, prompt, 10, ignore_eos=True)  # the processing changes the answer
    kw = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=0, extra_body=fields)
    client = served.client()
    if stream:
        tokens = [
            t
            for ch in client.completions.create(stream=True, **kw)
            if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.tokens
        ]
    else:
        tokens = client.completions.create(**kw).choices[0].logprobs.tokens
    assert tokens == [tok.decode([i]) for i in want]
