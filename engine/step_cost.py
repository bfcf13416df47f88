"""One engine step's cost in seconds, as the planner fits it (bench/plan/) and the mock engine sleeps it
(engine/mock.py): ``base + per_token * new_tokens + per_attn * attn_pairs + per_seq * seqs
+ per_key * decode_keys``. Written once here, below both."""

from __future__ import annotations

from dataclasses import asdict, dataclass


def chunk_attn_pairs(start: int, end: int) -> int:
    """Attention pairs the engine computes for prompt positions [start, end)."""
    if start == 0:
        return end * (end + 1) // 2  # causal kernel: the upper triangle is skipped
    return (end - start) * end  # masked over every key: nothing is skipped


@dataclass(frozen=True)
class StepCost:
    base: float
    per_token: float
    per_attn: float
    per_seq: float
    per_key: float = 0.0

    def step_time(self, new_tokens: int, attn_pairs: int, seqs: int, decode_keys: int = 0) -> float:
        return (
            self.base
            + self.per_token * new_tokens
            + self.per_attn * attn_pairs
            + self.per_seq * seqs
            + self.per_key * decode_keys
        )

    def prefill_time(self, prompt_len: int) -> float:
        """One prompt prefilled in one step."""
        return self.step_time(prompt_len, chunk_attn_pairs(0, prompt_len), 1)

    def decode_time(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences of ``context`` tokens each."""
        return self.step_time(batch, 0, batch, batch * (context + 1))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> StepCost:
        return cls(
            **{k: float(data[k]) for k in ("base", "per_token", "per_attn", "per_seq")},
            per_key=float(data.get("per_key", 0.0)),
        )
