"""Structured output: a grammar the generated tokens must match (llguidance).

``compile_grammar(spec)`` turns an ``engine.request.StructuredSpec`` into an
llguidance grammar, checked, or raises ``ValueError`` naming the problem. It
imports no torch, so the router calls it too, to refuse a bad spec with a
400 before any server sees it (the servers compile again: they do not trust
the router).

``check_bounds(spec, limits)`` refuses, before anything is compiled, a
spec larger than ``GrammarLimits`` allow: the library compiles a grammar
recursively (about six native frames per chained Lark rule, so 3000 rules
overflow an 8 MiB stack and kill the process), and its cost grows with the
branches it must try. The router checks its configured limits; the engine
checks ``GRAMMAR_CEILING``, the most any configuration may allow.

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
from dataclasses import dataclass, fields

import llguidance

KINDS = ("json_schema", "regex", "choice", "lark")
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarLimits:
    """How large a grammar, JSON schema, regex or choice list a request may send."""

    max_bytes: int = 65536  # its text (a grammar, the schema as JSON, the regex, the choices as JSON)
    max_rules: int = 500  # rule and terminal definitions in a Lark grammar (each a level of recursion)
    max_depth: int = 32  # nesting: of a JSON schema's objects and lists, of a grammar's or regex's groups
    max_branches: int = 512  # alternatives: anyOf/oneOf/allOf and enum items, choices, '|' in a grammar or regex

    def __post_init__(self) -> None:
        for f in fields(self):
            value, most = getattr(self, f.name), _CEILING[f.name]
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
            if value > most:
                raise ValueError(f"{f.name} is at most {most} (what the grammar compiler survives), got {value}")


# The most any configuration may allow: 1500 chained rules compile within a 8 MiB thread stack with
# room to spare (2500 did, 3000 did not), and llguidance refuses deeper nesting and rows of more than
# 2000 items itself. The servers check this; the router checks its own (smaller) limits.
_CEILING = {"max_bytes": 1 << 20, "max_rules": 1500, "max_depth": 64, "max_branches": 2000}
GRAMMAR_CEILING = GrammarLimits(**_CEILING)


def check_bounds(spec, limits: GrammarLimits) -> None:
    """ValueError naming the limit when ``spec`` is larger than ``limits`` allow; costs O(len(value))."""
    kind, value = spec.kind, spec.value
    size = len(value.encode())
    if size > limits.max_bytes:
        raise ValueError(
            f"the {_NAMES.get(kind, kind)} has {size} bytes; at most {limits.max_bytes} bytes are accepted"
        )
    if kind in ("json_schema", "choice"):
        depth, branches = _json_shape(_loads(value, kind))
        rules = 0
    elif kind in ("regex", "lark"):
        rules, depth, branches = _text_shape(value, lark=kind == "lark")
    else:
        raise ValueError(f"unknown structured output kind {kind!r} (one of {list(KINDS)})")
    for what, count, most in (
        ("rules", rules, limits.max_rules),
        ("levels of nesting", depth, limits.max_depth),
        ("alternatives", branches, limits.max_branches),
    ):
        if count > most:
            raise ValueError(f"the {_NAMES[kind]} has {count} {what}; at most {most} are accepted")


_ALTERNATIVES = ("anyOf", "oneOf", "allOf", "enum")


def _json_shape(doc) -> tuple[int, int]:
    """(the deepest nesting of objects and lists, the alternatives: items of anyOf/oneOf/allOf/enum, or of
    a top-level list), walked without recursion."""
    deepest, branches = 0, len(doc) if isinstance(doc, list) else 0
    stack = [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items = node.values()
            branches += sum(len(node[k]) for k in _ALTERNATIVES if isinstance(node.get(k), list))
        elif isinstance(node, list):
            items = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in items)
    return deepest, branches


def _text_shape(text: str, lark: bool) -> tuple[int, int, int]:
    """(rule definitions, deepest nesting of ( [ {, '|' alternatives) of a Lark grammar or a regex,
    skipping what is quoted: string literals and, in Lark, /regex/ literals and // comments."""
    rules = depth = deepest = branches = 0
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if c == "\\" and not lark:
            i += 2  # an escaped character of a regex
            continue
        if lark and line_start and not c.isspace():
            j = i + (text[i] in "?!")
            k = j
            while k < n and (text[k].isalnum() or text[k] in "_."):
                k += 1
            while k < n and text[k] in " \t":
                k += 1
            if k > j and k < n and text[k] == ":":
                rules += 1
        if c == "\n":
            line_start = True
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if lark and c == "/" and text.startswith("//", i):
            i = _skip_to(text, i, "\n") - 1  # a comment runs to the end of the line
        elif lark and c in '"/':
            i = _skip_to(text, i + 1, c)
        elif not lark and c == "[":
            i = _skip_class(text, i)
            deepest = max(deepest, depth + 1)
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(0, depth - 1)
        elif c == "|":
            branches += 1
        i += 1
    return rules, deepest, branches


def _skip_to(text: str, i: int, end: str) -> int:
    """The index of the unescaped ``end`` from ``i`` on (or the text's length)."""
    n = len(text)
    while i < n and text[i] != end:
        i += 2 if text[i] == "\\" else 1
    return i


def _skip_class(text: str, i: int) -> int:
    """The index of the ']' closing the regex character class opened at ``i``."""
    i += 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":
        i += 1
    return _skip_to(text, i, "]")


def _loads(value: str, kind: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the {_NAMES[kind]} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"the {_NAMES[kind]} is nested too deeply") from None


def compile_grammar(spec) -> str:
    """The llguidance grammar of ``spec`` (``kind`` one of KINDS, ``value`` text), validated.

    Raises ValueError with a message fit for a client: what is wrong and where.
    """
    kind, value = spec.kind, spec.value
    if kind == "json_schema":
        schema = _loads(value, kind)
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object or a boolean")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        choices = _loads(value, kind)
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


_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "choice": "choice list", "lark": "grammar"}


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

    def __init__(
        self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int | None = None
    ) -> None:
        self.vocab_size = vocab_size  # the model's logits width (at least the tokenizer's)
        self.eos_token_ids = frozenset(eos_token_ids)
        import llguidance.hf  # here: it imports transformers, which compile_grammar's callers need not load

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.executor = llguidance.LLExecutor(num_threads=num_threads)

    def grammar(self, spec) -> Grammar:
        """A fresh matcher for ``spec``; ValueError when it exceeds ``GRAMMAR_CEILING`` or does not compile
        for this tokenizer."""
        check_bounds(spec, GRAMMAR_CEILING)
        matcher = llguidance.LLMatcher(self.tokenizer, compile_grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {_NAMES[spec.kind]} does not compile: {matcher.get_error()}")
        return Grammar(matcher, self)
