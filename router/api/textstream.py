"""Token ids -> text, incrementally, and stop strings.

``IncrementalDetokenizer`` turns each batch of new token ids into the text it
adds. Decoding a token on its own is wrong twice over: a multi-byte UTF-8
character can be split across tokens (decoding the first half gives U+FFFD),
and SentencePiece-style tokenizers decide about a leading space from the token
before. So it keeps a small window of ids (``prefix_offset``..``read_offset``
already shown, ``read_offset``.. new) and emits only text that decodes cleanly,
the same scheme as vLLM and TGI.

``StopMatcher`` holds back text that could be the start of a stop string and
cuts the output where one appears (the stop string itself is not returned, as
in OpenAI's API).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.api.fast_tokens import decoder

REPLACEMENT = "\ufffd"
# How many prompt tokens to keep as context so the first output token
# decodes with the right leading space.
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int]) -> None:
        self._decode = decoder(tokenizer)  # skipping special tokens, no clean-up (router/api/fast_tokens.py)
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now certain."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


class StopMatcher:
    """Feeds text through, stopping at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Return the text safe to emit now; sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._longest_partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
