"""The tokenizer's Rust backend, called directly where transformers' call comes down to it.

For a stock ``TokenizersBackend`` (the fast tokenizer classes transformers ships for the served
families), ``tokenizer(text, add_special_tokens=a)["input_ids"]`` with no truncation or padding
is the backend's ``encode(text, add_special_tokens=a).ids``, and ``tokenizer.decode(ids,
skip_special_tokens=True, clean_up_tokenization_spaces=False)`` is the backend's ``decode(ids,
skip_special_tokens=True)``. The Python around them (arguments, ``BatchEncoding``, the backend's
settings set again on every call) costs about 40 us a prompt and 9 us a decode, against 15 and
0.4 us for the backend alone; a stream's detokenizer decodes twice per batch of new tokens. A
tokenizer class that overrides any of those calls, or a backend left truncating or padding, goes
through transformers as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache, partial
from typing import Any

from transformers.tokenization_utils_tokenizers import TokenizersBackend

# What a call to the tokenizer or its decode runs; a class that overrides any of them may answer otherwise.
_CALLS = (
    "__call__",
    "_get_padding_truncation_strategies",
    "_switch_to_input_mode",
    "_encode_plus",
    "set_truncation_and_padding",
    "decode",
    "_decode",
)

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]


@cache
def _stock(cls: type) -> bool:
    """Whether ``cls`` tokenizes and decodes exactly as ``TokenizersBackend`` does."""
    return issubclass(cls, TokenizersBackend) and all(
        getattr(cls, name, None) is getattr(TokenizersBackend, name, None) for name in _CALLS
    )


def _settled_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer behind a stock ``tokenizer``, after one ordinary call has set it up as every
    call of the router's does (no truncation, no padding, ``split_special_tokens`` applied); None for
    another tokenizer, or a backend that call did not leave so."""
    if not _stock(tokenizer.__class__):
        return None
    tokenizer("")
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(tokenizer.split_special_tokens):
        return None
    return backend


def encoder(tokenizer: Any, add_special_tokens: bool) -> Encode:
    """``text -> ids``, as ``tokenizer(text, add_special_tokens=...)["input_ids"]``."""
    backend = _settled_backend(tokenizer)
    if backend is None:
        return lambda text: list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    encode = backend.encode
    return lambda text: encode(text, add_special_tokens=add_special_tokens).ids


def decoder(tokenizer: Any) -> Decode:
    """``ids -> text`` without special tokens and without clean-up, as a stream's detokenizer decodes."""
    if _stock(tokenizer.__class__):
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)
