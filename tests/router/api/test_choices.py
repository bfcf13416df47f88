"""One choice's text and tokens (router/api/choices.py): a token goes out with the text it adds,
and a stop string cuts text and tokens alike."""

import pytest

from router.api.choices import ChoiceText
from tests.support.fakes import make_byte_tokenizer
from wire.replies import TokenLogprob, TokensEvent


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_byte_tokenizer(tmp_path_factory.mktemp("bytetok")))


def feed(tokenizer, text: str, stops: list[str], last_reason: str = "length"):
    ids = tokenizer(text)["input_ids"]
    choice = ChoiceText(3, tokenizer, tokenizer("p")["input_ids"], stops, scored=True)
    deltas = []
    for k, t in enumerate(ids):
        event = TokensEvent(
            token_ids=[t],
            logprobs=[TokenLogprob(logprob=-float(k))],
            finish_reason=last_reason if k == len(ids) - 1 else None,
        )
        delta = choice.push(event)
        if delta is not None:
            deltas.append(delta)
    return ids, deltas


def test_a_multibyte_character_s_tokens_go_out_with_it(tokenizer):
    ids, deltas = feed(tokenizer, "a€b", [])
    assert [(d.text, [s.token_id for s in d.tokens]) for d in deltas] == [
        ("a", ids[:1]),
        ("€", ids[1:4]),
        ("b", ids[4:]),
    ]
    assert [s.logprob.logprob for d in deltas for s in d.tokens] == [0.0, -1.0, -2.0, -3.0, -4.0]
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 5 and deltas[0].index == 3


def test_a_stop_string_keeps_the_tokens_of_the_text_before_it_and_drops_its_own(tokenizer):
    ids, deltas = feed(tokenizer, "one, two", [", t"], last_reason="stop")
    assert "".join(d.text for d in deltas) == "one"
    assert [s.token_id for d in deltas for s in d.tokens] == ids[:3]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].completion_tokens == 6
