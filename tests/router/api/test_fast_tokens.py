"""The tokenizer's backend called directly (router/api/fast_tokens.py) gives exactly what transformers'
calls give: ids for text with and without special tokens, and text for ids, special ones skipped."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from router.api import fast_tokens
from router.api.fast_tokens import decoder, encoder
from router.api.model import ServedModel
from tests.support.fakes import make_byte_tokenizer

TEXTS = [
    "",
    " ",
    "hello world",
    "  two  spaces\tand a tab\n\nand lines\r\n",
    "héllo € 🙂 日本語のテキスト",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> inside <|im_end|>text",
    "<|im_start|",  # half a special token
    "\ufdd0\u2028\x00\x85 odd code points",
    "word " * 700,  # longer than any context the tests' models have
]


@pytest.fixture(scope="module", params=["bytes", "qwen3", "llama"])
def tokenizer(request, tmp_path_factory):
    if request.param == "bytes":
        folder = str(make_byte_tokenizer(tmp_path_factory.mktemp("bytetok")))
    else:
        folder = request.getfixturevalue("tiny_model" if request.param == "qwen3" else "tiny_llama_model")
    return AutoTokenizer.from_pretrained(folder)


def test_the_tests_tokenizers_take_the_backend_path(tokenizer):
    """Otherwise the tests below compare transformers with itself."""
    assert fast_tokens._settled_backend(tokenizer) is not None


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_text_encodes_to_the_ids_transformers_gives(tokenizer, add_special_tokens):
    encode = encoder(tokenizer, add_special_tokens=add_special_tokens)
    for text in TEXTS:
        assert encode(text) == list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), text


def test_ids_decode_to_the_text_transformers_gives(tokenizer):
    decode = decoder(tokenizer)
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    sequences = [[], special, [*special, 5, 6]] + [
        [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))] for _ in range(300)
    ]
    sequences += [tokenizer(text)["input_ids"] for text in TEXTS]
    for ids in sequences:
        want = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert decode(ids) == want, ids


def test_the_served_model_encodes_prompts_and_templated_chats_as_transformers(tiny_model):
    model = ServedModel.load("tiny", tiny_model)
    tok = model.tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo <|im_end|> 🙂"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert model.encode_chat(messages) == list(tok(text, add_special_tokens=False)["input_ids"])
    for prompt in TEXTS:
        assert model.encode_prompt(prompt) == list(tok(prompt)["input_ids"])


class _OwnDecode(TokenizersBackend):
    """A tokenizer class that decodes its own way."""

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
        return "own:" + super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)


def test_a_class_that_overrides_a_call_goes_through_transformers(tmp_path):
    tok = _OwnDecode.from_pretrained(str(make_byte_tokenizer(tmp_path / "bytetok")))
    assert fast_tokens._settled_backend(tok) is None
    assert decoder(tok)([71, 72]) == "own:" + tok.backend_tokenizer.decode([71, 72])
    assert encoder(tok, add_special_tokens=True)("hi") == list(tok("hi")["input_ids"])
