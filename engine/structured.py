"""Structured output: a grammar the generated tokens must match (llguidance).

``compile_grammar(spec)`` turns an ``engine.request.StructuredSpec`` into an
llguidance grammar, checked, or raises ``ValueError`` naming the problem. It
imports no torch, so the router calls it too, to refuse a bad spec with a
400 before any server sees it (the servers compile again: they do not trust
the router).

``StructuredOutputs`` is built once per engine from its Hugging Face tokenizer
and makes a ``Grammar`` (a matcher) per request. The engine's part of the
contract:

- before sampling, the rows of requests with a grammar get every token the
  matcher disallows set to -inf (``engine/grammar_mask.py``);
- each token appended to a request's output (sampled, or the first token a
  prefill server sent) is fed to ``Grammar.accept``;
- a grammar that is complete allows only EOS; once EOS was accepted
  (``Grammar.done``) the request stops with finish_reason "stop", even with
  ``ignore_eos``;
- ``Grammar.fork()`` gives an independent copy (a sequence of n > 1).

JSON is generated without free whitespace (``{"a":1,"b":[2,3]}``): with
flexible whitespace a small model can spend its whole budget on blanks.
"""

from __future__ import annotations

import json

import llguidance

KINDS = ("json_schema", "regex", "choice", "lark")
JSON_OPTIONS = {"whitespace_flexible": False}


def compile_grammar(spec) -> str:
    """The llguidance grammar of ``spec`` (``kind`` one of KINDS, ``value`` text), validated.

    Raises ValueError with a message fit for a client: what is wrong and where.
    """
    kind, value = spec.kind, spec.value
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object or a boolean")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        try:
            choices = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the choices are not valid JSON: {exc}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("the choices must be a non-empty list of non-empty strings")
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    elif kind == "lark":
        grammar = llguidance.LLMatcher.grammar_from_lark(value)
    else:
        raise ValueError(f"unknown structured output kind {kind!r} (one of {list(KINDS)})")
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"the {_NAMES[kind]} does not compile: {messages[0].strip()}")
    return grammar


_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "choice": "choice list",
          "lark": "grammar"}


class Grammar:
    """One request's matcher: which tokens may come next, fed every token the request produces."""

    def __init__(self, matcher: llguidance.LLMatcher, owner: StructuredOutputs) -> None:
        self.matcher = matcher
        self.owner = owner  # the engine's tokenizer and executor (grammar_mask.py computes masks with it)
        self.done = False  # EOS accepted: the output is complete

    def accept(self, token_id: int) -> bool:
        """Feed one output token; False when the grammar does not allow it (the matcher is then in error)."""
        if self.done:
            return token_id in self.owner.eos_token_ids
        if not self.matcher.consume_token(token_id):
            return False
        self.done = token_id in self.owner.eos_token_ids
        return True

    def allows(self, token_id: int) -> bool:
        """Whether ``accept(token_id)`` would succeed (the state is not changed)."""
        if self.done:
            return token_id in self.owner.eos_token_ids
        if not 0 <= token_id < self.owner.vocab_size:
            return False
        mask = self.matcher.compute_bitmask()  # (validate_tokens does not count EOS as allowed)
        return bool(mask[token_id // 8] >> (token_id % 8) & 1)

    @property
    def finishing(self) -> bool:
        """The output so far is complete and nothing but EOS may follow (min_tokens then yields)."""
        return self.done or self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()

    def fork(self) -> Grammar:
        """An independent copy in the same state."""
        copy = Grammar(self.matcher.deep_copy(), self.owner)
        copy.done = self.done
        return copy


class StructuredOutputs:
    """The engine's llguidance tokenizer (built once from its Hugging Face tokenizer) and mask executor."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size  # the model's logits width (at least the tokenizer's)
        self.eos_token_ids = frozenset(eos_token_ids)
        import llguidance.hf  # here: it imports transformers, which compile_grammar's callers need not load

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids))
        self.executor = llguidance.LLExecutor(num_threads=num_threads)

    def grammar(self, spec) -> Grammar:
        """A fresh matcher for ``spec``; ValueError when it does not compile for this tokenizer."""
        matcher = llguidance.LLMatcher(self.tokenizer, compile_grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {_NAMES[spec.kind]} does not compile: {matcher.get_error()}")
        return Grammar(matcher, self)
