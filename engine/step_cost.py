"""One engine step's cost in seconds, as the planner fits it (bench/plan/) and the mock engine sleeps it
(engine/mock.py): ``base + per_token * new_tokens + per_attn * attn_pairs + per_seq * seqs
+ per_key * decode_keys``. Written once here, below both."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


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


# Round figures of a small model's step on a CPU core, not a measurement: a decode step of one 512-token
# sequence about 5 ms, a 512-token prompt about 55 ms. Give a profile (`engine.mock_profile`) to model a
# calibrated machine.
DEFAULT_STEP_COST = StepCost(base=0.004, per_token=0.0001, per_attn=1e-8, per_seq=0.0002, per_key=2e-6)


def load_step_cost(path: str | Path, threads: int | None = None) -> StepCost:
    """The step cost of a `pdserve plan --save-profile` file (bench/plan/profile.py ``Profile.to_json``) at
    ``threads`` torch threads: that count's, else the nearest profiled count below it, else the lowest."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        costs = {int(t): c for t, c in data["step_costs"].items()}
        known = sorted(costs)
        below = [t for t in known if threads is not None and t <= threads]
        chosen = costs[below[-1] if below else known[0]]
        names = [f.name for f in fields(StepCost)]
        return StepCost(**{n: float(chosen[n]) for n in names if n in chosen})
    except OSError as exc:
        raise FileNotFoundError(f"mock profile {str(path)!r} cannot be read: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"mock profile {str(path)!r} is not a pdserve profile ({type(exc).__name__}: {exc})") from None
