import pytest

from router.api.textstream import IncrementalDetokenizer, StopMatcher
from tests.support.fakes import make_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_byte_tokenizer(tmp_path_factory.mktemp("bytetok")))


def stream_text(tokenizer, prompt: str, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer(prompt)["input_ids"])
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    return pieces


def test_multibyte_characters_split_across_tokens_come_out_whole(tokenizer):
    text = "héllo € 🙂 日本"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text)  # one token per byte
    pieces = stream_text(tokenizer, "say: ", ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "🙂" in pieces  # emitted once all four bytes are in, not before


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer("a€")["input_ids"][:-1]  # cut the euro sign's last byte
    pieces = stream_text(tokenizer, "", ids)
    assert pieces[0] == "a"
    assert "".join(pieces) == "a\ufffd"


def test_special_tokens_are_not_shown(tokenizer):
    ids = tokenizer("ok")["input_ids"] + [tokenizer.eos_token_id]
    assert "".join(stream_text(tokenizer, "", ids)) == "ok"


def test_stop_string_cuts_the_text_and_is_not_returned():
    m = StopMatcher(["END"])
    assert m.push("hello E") == "hello "  # "E" might start "END": held back
    assert m.push("N") == ""
    assert not m.stopped
    assert m.push("D and more") == ""
    assert m.stopped


def test_stop_string_false_start_is_released():
    m = StopMatcher(["END"])
    assert m.push("xE") == "x"
    assert m.push("Nx") == "ENx"
    assert m.flush() == ""
    assert not m.stopped


def test_earliest_of_several_stop_strings_wins():
    m = StopMatcher(["b", "a"])
    assert m.push("xxab") == "xx"
    assert m.stopped
    assert m.push("more") == ""


def test_held_text_is_released_at_the_end():
    m = StopMatcher(["</s>"])
    assert m.push("done </") == "done "
    assert m.flush() == "</"


def test_no_stop_strings_pass_everything_through():
    m = StopMatcher([])
    assert m.push("abc") == "abc"
    assert m.flush() == ""
