"""Synthetic prompts whose token count is exact for the model's tokenizer.

A prompt of N tokens is built from a pool of "word" tokens: vocabulary
entries that decode to one space-prefixed lowercase word and encode back to
themselves. Byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece split
text at spaces before merging, so a sequence of such words encodes to
exactly those tokens. Every prompt is still encoded once to verify, and
trimmed or padded word by word until it is exact; a tokenizer for which that
fails is reported with a clear error (send token ids instead).

N counts what the server's tokenizer counts for a completions prompt:
``tokenizer.encode(text)``, special tokens such as a BOS included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_WORD = re.compile(r"^ [a-z]{2,12}$")
_MAX_FIXUPS = 32


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def load_tokenizer(path: str | Path):
    """The tokenizer of a local Hugging Face folder (never downloads)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(path)!r} does not exist")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class PromptBuilder:
    """Builds random prompts of exact token lengths for one tokenizer."""

    def __init__(self, tokenizer, max_pool: int = 4096):
        self.tokenizer = tokenizer
        self.num_special = len(tokenizer.encode(""))
        self.pool = self._word_pool(max_pool)
        if len(self.pool) < 8:
            raise ValueError(
                "this tokenizer has too few plain word tokens to build exact-length text "
                "prompts; use --prompt-format tokens"
            )

    def _word_pool(self, max_pool: int) -> list[tuple[int, str]]:
        tok = self.tokenizer
        special = set(tok.all_special_ids)
        pool = []
        for token_id in range(len(tok)):
            if token_id in special:
                continue
            text = tok.decode([token_id])
            if not _WORD.match(text):
                continue
            if tok.encode(text, add_special_tokens=False) != [token_id]:
                continue
            pool.append((token_id, text))
            if len(pool) >= max_pool:
                break
        return pool

    def build(self, num_tokens: int, rng: np.random.Generator) -> Prompt:
        """A prompt that encodes to exactly ``num_tokens`` tokens."""
        target = num_tokens - self.num_special
        if target < 1:
            raise ValueError(
                f"prompt length {num_tokens} is too short: the tokenizer adds {self.num_special} special tokens"
            )
        words = [self.pool[i][1] for i in rng.integers(0, len(self.pool), size=target)]
        # The first word keeps its leading space: "hello" and " hello" are different
        # tokens, and the pool was checked with the space.
        for _ in range(_MAX_FIXUPS):
            text = "".join(words)
            ids = self.tokenizer.encode(text)
            if len(ids) == num_tokens:
                return Prompt(text, ids)
            excess = len(ids) - num_tokens  # each word is about one token
            if excess > 0:
                del words[max(1, len(words) - excess) :]
            else:
                words.extend(self.pool[i][1] for i in rng.integers(0, len(self.pool), size=-excess))
        raise ValueError(
            f"could not build a text prompt of exactly {num_tokens} tokens with this "
            "tokenizer; use --prompt-format tokens"
        )

    def from_segments(self, segments, seed: int) -> Prompt:
        """The words of each segment (``bench.load.prefix_workload.Segment``: a key seeds its words), joined:
        prompts with equal leading segments share exactly those tokens. Exactly ``num_special`` plus
        the segments' lengths tokens, or ValueError."""
        words = []
        for segment in segments:
            rng = np.random.default_rng([seed, *segment.key])
            words.extend(self.pool[i][1] for i in rng.integers(0, len(self.pool), size=segment.length))
        text = "".join(words)
        ids = self.tokenizer.encode(text)
        if len(ids) != self.num_special + len(words):
            raise ValueError(
                f"words of this tokenizer did not encode one token each ({len(ids)} tokens for "
                f"{len(words)} words); use another tokenizer"
            )
        return Prompt(text, ids)
