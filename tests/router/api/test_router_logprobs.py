"""Log-probabilities, echo, n and prompt lists in the router, against scripted workers, read with
the official openai SDK (so the shapes are the ones it parses). The fake servers score the token
at position k -(k + 1), with top tokens 0, 1, ... (tests/support/fakes.py)."""

from __future__ import annotations

import openai
import pytest

from tests.support.fakes import FakeWorkerClient
from tests.support.router_client import make_client, reply_ids


def sdk(c) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=c, max_retries=0)


def text_of(model, token_id: int) -> str:
    return model.tokenizer.decode([token_id])


@pytest.mark.parametrize(
    "local, delay",
    [(False, 0.0), (False, 0.02), (True, 0.0)],
    ids=["remote-decode-first", "remote-prefill-result-first", "local"],
)
def test_chat_logprobs_have_every_token_and_its_top_ones_the_first_from_the_prefill_server(model, local, delay):
    fake = FakeWorkerClient(reply=reply_ids(model, "abc"), finish_reason="length", delay=delay)
    with make_client(model, fake, local_prefill_threshold=1000 if local else 0) as c:
        r = sdk(c).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, max_tokens=3
        )
    assert [req.local_prefill for _, req in fake.opened] == [local]
    assert len(fake.prefills) == (0 if local else 1)
    content = r.choices[0].logprobs.content
    assert [(x.token, x.logprob, x.bytes) for x in content] == [("a", -1.0, [97]), ("b", -2.0, [98]), ("c", -3.0, [99])]
    assert [[(t.token, t.logprob) for t in x.top_logprobs] for x in content] == [
        [(text_of(model, 0), -0.5), (text_of(model, 1), -1.0)]
    ] * 3


def test_streamed_chat_chunks_carry_the_logprobs_of_their_text_and_a_stop_string_cuts_both(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "ab, cd"))
    with make_client(model, fake) as c:
        chunks = list(
            sdk(c).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, stream=True, stop=[", "]
            )
        )
    pieces = [
        (ch.choices[0].delta.content, [x.token for x in ch.choices[0].logprobs.content])
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
    ]
    assert "".join(text for text, _ in pieces) == "ab"
    assert all(text == "".join(tokens) for text, tokens in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_echo_puts_the_prompt_and_its_scores_first_and_max_tokens_0_scores_the_prompt_only(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "xy"))
    with make_client(model, fake) as c:
        r = sdk(c).completions.create(model="tiny", prompt="hey", echo=True, logprobs=1, max_tokens=2)
        zero = sdk(c).completions.create(model="tiny", prompt="hey", echo=True, logprobs=1, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "heyxy"
    assert lp.tokens == ["h", "e", "y", "x", "y"]
    assert lp.token_logprobs == [None, -102.0, -103.0, -1.0, -2.0]  # prompt position i scores -(100 + i + 1)
    assert lp.top_logprobs[0] is None and lp.top_logprobs[3] == {text_of(model, 0): -0.5, "x": -1.0}
    assert lp.text_offset == [0, 1, 2, 3, 4]
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 2
    sent = fake.opened[0][1].sampling
    assert (sent.logprobs, sent.prompt_logprobs) == (1, 1)
    assert zero.choices[0].text == "hey" and zero.choices[0].logprobs.tokens == ["h", "e", "y"]
    assert zero.usage.completion_tokens == 0 and zero.choices[0].finish_reason == "length"
    assert fake.opened[1][1].sampling.max_tokens == 1


def test_prompt_logprobs_come_in_vllm_s_shape(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "x"))
    with make_client(model, fake) as c:
        r = sdk(c).completions.create(model="tiny", prompt="ab", max_tokens=1, extra_body={"prompt_logprobs": 1})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None
    (b,) = reply_ids(model, "b")
    assert got[1] == {
        str(b): {"logprob": -102.0, "rank": None, "decoded_token": "b"},
        "0": {"logprob": -0.5, "rank": 1, "decoded_token": text_of(model, 0)},
    }


def test_n_sequences_are_numbered_choices_with_usage_counting_the_prompt_once(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "ok"))
    with make_client(model, fake) as c:
        r = sdk(c).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3)
        chunks = list(sdk(c).completions.create(model="tiny", prompt="p", n=2, stream=True))
    assert [(ch.index, ch.message.content, ch.finish_reason) for ch in r.choices] == [
        (0, "ok", "stop"),
        (1, "ok", "stop"),
        (2, "ok", "stop"),
    ]
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == fake.opened[0][1].prompt_token_ids.__len__()
    assert len(fake.opened) == 2 and fake.opened[0][1].sampling.n == 3 and len(fake.prefills) == 2
    texts = {0: "", 1: ""}
    for ch in chunks:
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == {0: "ok", 1: "ok"}


def test_a_list_of_prompts_is_one_request_each_one_choice_per_prompt_and_sequence(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "z"))
    with make_client(model, fake) as c:
        r = sdk(c).completions.create(model="tiny", prompt=["a", "bb", "abc"], n=2, echo=True, max_tokens=1)
        ids = sdk(c).completions.create(
            model="tiny", prompt=[reply_ids(model, "q"), reply_ids(model, "rs")], max_tokens=1, echo=True
        )
        chunks = list(sdk(c).completions.create(model="tiny", prompt=["a", "bb"], stream=True, max_tokens=1))
    assert [(ch.index, ch.text) for ch in r.choices] == [
        (0, "az"),
        (1, "az"),
        (2, "bbz"),
        (3, "bbz"),
        (4, "abcz"),
        (5, "abcz"),
    ]
    assert r.usage.prompt_tokens == 1 + 2 + 3 and r.usage.completion_tokens == 6
    assert sorted(req.prompt_token_ids for _, req in fake.opened[:3]) == sorted(
        [reply_ids(model, "a"), reply_ids(model, "bb"), reply_ids(model, "abc")]
    )
    assert [(ch.index, ch.text) for ch in ids.choices] == [(0, "qz"), (1, "rsz")]
    assert sorted((ch.choices[0].index, ch.choices[0].text) for ch in chunks) == [(0, "z"), (1, "z")]


def test_a_prompt_of_the_list_that_cannot_be_served_fails_the_request_and_aborts_the_others(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "z"))
    with make_client(model, fake) as c:
        with pytest.raises(openai.BadRequestError):
            sdk(c).completions.create(model="tiny", prompt=["a", [99999]], max_tokens=1)
    assert fake.opened == []


def test_streamed_prompt_logprobs_come_once_for_chat_and_on_each_completion_choice_s_first_chunk(model):
    fake = FakeWorkerClient(reply=reply_ids(model, "ok"))
    with make_client(model, fake) as c:
        chat = list(
            sdk(c).chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                n=2,
                stream=True,
                extra_body={"prompt_logprobs": 0},
            )
        )
        comp = list(
            sdk(c).completions.create(
                model="tiny", prompt="ab", n=2, stream=True, max_tokens=2, extra_body={"prompt_logprobs": 0}
            )
        )
    prompt = fake.opened[0][1].prompt_token_ids
    with_prompt = [ch.model_extra["prompt_logprobs"] for ch in chat if ch.model_extra.get("prompt_logprobs")]
    assert len(with_prompt) == 1 and len(with_prompt[0]) == len(prompt) and with_prompt[0][0] is None
    firsts = {}
    for ch in comp:
        firsts.setdefault(ch.choices[0].index, ch.choices[0].model_extra["prompt_logprobs"])
    (b,) = reply_ids(model, "b")
    assert firsts == {i: [None, {str(b): {"logprob": -102.0, "rank": None, "decoded_token": "b"}}] for i in (0, 1)}
    assert "".join(ch.choices[0].text for ch in comp if ch.choices[0].index == 1) == "ok"
