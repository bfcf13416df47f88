"""Workloads whose prompts share prefixes: multi-turn chat and a shared system prompt.

A prompt is a list of ``Segment``s, each a run of words drawn from a generator
seeded by the segment's ``key`` (bench/load/prompts.py, ``PromptBuilder.from_segments``),
so two prompts with the same leading segments share exactly those tokens.

``shared_prefix``: request i is the shared prefix ``i % groups`` (``shared_tokens``
words) followed by its own question (``question`` words).

``multi_turn``: ``conversations`` chats run side by side, ``turns`` turns each;
request i is turn ``(i // conversations) % turns`` of chat ``i % conversations``
(a new set of chats after ``turns`` rounds), and its prompt is every earlier
question and answer of that chat followed by the new question. The earlier
answers are words of the output length, not what the server answered, so that
lengths stay exact and runs compare. With a closed loop of at most
``conversations`` requests in flight, turn t of a chat is sent after turn t-1
was sent (and, in practice, answered). To continue chats from the server's own
answers instead (``bench serve --history messages`` or ``previous-response``,
``/v1/responses``), the load client sends only each turn's question from here
(``position`` names its chat and turn) and keeps the rest (bench/load/loadgen.py).

A prompt's length is ``num_special`` (the tokenizer's BOS, if any) plus the
sum of its segments' lengths, exactly: the builder checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from bench.load.workload import LengthDist

QUESTION, ANSWER, PREFIX = 0, 1, 2


@dataclass(frozen=True)
class Segment:
    key: tuple[int, ...]  # seeds the words (with the run's seed)
    length: int  # words, one token each


@dataclass(frozen=True)
class PrefixWorkload:
    kind: Literal["shared_prefix", "multi_turn"]
    question: LengthDist
    output: LengthDist
    shared_tokens: int = 0
    groups: int = 1
    turns: int = 1
    conversations: int = 8

    def __post_init__(self) -> None:
        if self.kind == "shared_prefix" and (self.shared_tokens < 1 or self.groups < 1):
            raise ValueError("a shared prefix needs at least 1 token and 1 group")
        if self.kind == "multi_turn" and (self.turns < 1 or self.conversations < 1):
            raise ValueError("multi-turn needs at least 1 turn and 1 conversation")

    def _lengths(self, seed: int, *key: int) -> tuple[int, int]:
        rng = np.random.default_rng([seed, *key])
        return self.question.sample(rng), self.output.sample(rng)

    def request(self, index: int, seed: int = 0) -> tuple[list[Segment], int]:
        """(prompt segments, output length) of request ``index`` (negative: warmup, its own prompts)."""
        warm = int(index < 0)
        i = abs(index)
        if self.kind == "shared_prefix":
            q, out = self._lengths(seed, warm, QUESTION, i)
            return [Segment((PREFIX, i % self.groups), self.shared_tokens), Segment((QUESTION, warm, i), q)], out
        chat, turn = self.position(index)
        segments = []
        for t in range(turn + 1):
            q, a = self._lengths(seed, warm, chat, t)
            segments.append(Segment((QUESTION, warm, chat, t), q))
            if t < turn:
                segments.append(Segment((ANSWER, warm, chat, t), a))
        return segments, self._lengths(seed, warm, chat, turn)[1]

    def position(self, index: int) -> tuple[int, int]:
        """(chat, turn) of multi-turn request ``index``; a warmup index (negative) has chats of its own,
        numbered the same way (its prompts differ: see ``request``)."""
        if self.kind != "multi_turn":
            raise ValueError("only a multi-turn workload has chats and turns")
        i = abs(index)
        chat = (i // (self.conversations * self.turns)) * self.conversations + i % self.conversations
        return chat, (i // self.conversations) % self.turns

    def best_hit_rate(self, count: int, num_special: int, seed: int = 0) -> float:
        """The share of prompt tokens a cache of unlimited size could reuse over requests 0..count-1,
        counted in tokens (the tokens each prompt shares with an earlier one, whole blocks aside)."""
        seen: set[tuple] = set()
        reusable = total = 0
        for i in range(count):
            segments, _ = self.request(i, seed)
            total += num_special + sum(s.length for s in segments)
            prefix: tuple = ()
            for s in segments:
                prefix += ((s.key, s.length),)
                if prefix in seen:
                    reusable += s.length + (num_special if len(prefix) == 1 else 0)
                else:
                    seen.add(prefix)
        return reusable / total if total else 0.0

    def __str__(self) -> str:
        if self.kind == "shared_prefix":
            return f"shared prefix {self.shared_tokens} x {self.groups} + question {self.question} -> {self.output}"
        return f"multi-turn {self.turns} x {self.conversations} chats, question {self.question} -> {self.output}"
