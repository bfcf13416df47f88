"""What the router must answer, from transformers `generate` on the same folder."""

from __future__ import annotations

import functools

from transformers import AutoTokenizer

from tests.engine.oracle import hf_greedy


@functools.lru_cache(maxsize=4)
def tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


def expected_completion(path: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """(text, completion tokens) of a greedy completion."""
    tok = tokenizer(path)
    ids = hf_greedy(path, tok(prompt)["input_ids"], max_tokens)
    return tok.decode(ids, skip_special_tokens=True), len(ids)


def chat_prompt_ids(path: str, messages: list[dict]) -> list[int]:
    tok = tokenizer(path)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def expected_chat(path: str, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    tok = tokenizer(path)
    ids = hf_greedy(path, chat_prompt_ids(path, messages), max_tokens)
    return tok.decode(ids, skip_special_tokens=True), len(ids)


PROMPTS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "A prefill server computes the prompt; a decode server streams the answer one token at a time. " * 3,
    "Café, naïve, über, 東京, 北京, emoji 🙂 and other multi-byte characters should survive.",
    "Once upon a time there was a small model that wanted to serve many users at once",
]
