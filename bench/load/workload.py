"""Workloads: length distributions, request classes and arrival processes.

A workload is a mix of request classes, each a weight, a prompt-length
distribution and an output-length distribution. Length specs are written

    512                 fixed
    uniform(128,1024)   uniform integers, both ends included
    normal(512,128)     normal, rounded, clipped to >= 1

and a class is ``WEIGHT:PROMPT:OUTPUT`` (``0.2:2048:16``). The same
:class:`Workload` drives the load client (which turns lengths into prompts
with :mod:`bench.load.prompts`) and the simulator (which only needs lengths).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SPEC = re.compile(r"^\s*(?:(\d+)|(uniform|normal)\(\s*([\d.]+)\s*,\s*([\d.]+)\s*\))\s*$")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts (always >= 1)."""

    kind: str  # fixed | uniform | normal
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        m = _SPEC.match(str(spec))
        if not m:
            raise ValueError(f"bad length spec {spec!r}: use N, uniform(LO,HI) or normal(MEAN,STD)")
        if m.group(1) is not None:
            value = int(m.group(1))
            if value < 1:
                raise ValueError(f"bad length spec {spec!r}: length must be >= 1")
            return cls("fixed", value)
        kind, a, b = m.group(2), float(m.group(3)), float(m.group(4))
        if kind == "uniform" and not 1 <= a <= b:
            raise ValueError(f"bad length spec {spec!r}: need 1 <= LO <= HI")
        if kind == "normal" and a < 1:
            raise ValueError(f"bad length spec {spec!r}: need MEAN >= 1")
        return cls(kind, a, b)

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        return max(1, int(round(rng.normal(self.a, self.b))))

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (int(self.a) + int(self.b)) / 2
        return float(self.a)

    @property
    def upper(self) -> int:
        """A bound no sample exceeds in practice (mean + 4 std for normal)."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        return int(math.ceil(self.a + 4 * self.b))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))

        def fmt(v):
            return str(int(v)) if float(v).is_integer() else str(v)

        return f"{self.kind}({fmt(self.a)},{fmt(self.b)})"


@dataclass(frozen=True)
class RequestClass:
    weight: float
    prompt: LengthDist
    output: LengthDist

    @classmethod
    def parse(cls, spec: str) -> RequestClass:
        parts = _split_top_level(spec, ":")
        if len(parts) != 3:
            raise ValueError(f"bad mix class {spec!r}: use WEIGHT:PROMPT:OUTPUT, e.g. 0.2:2048:16")
        try:
            weight = float(parts[0])
        except ValueError:
            raise ValueError(f"bad mix class {spec!r}: weight {parts[0]!r} is not a number") from None
        if weight <= 0:
            raise ValueError(f"bad mix class {spec!r}: weight must be > 0")
        return cls(weight, LengthDist.parse(parts[1]), LengthDist.parse(parts[2]))

    def __str__(self) -> str:
        return f"{self.weight:g}:{self.prompt}:{self.output}"


@dataclass(frozen=True)
class RequestSpec:
    """Lengths of one request; ``prompt`` is set for file workloads."""

    index: int
    prompt_len: int
    output_len: int
    prompt: str | list[int] | None = None


@dataclass(frozen=True)
class Workload:
    """A mix of request classes; sampled deterministically from a seed."""

    classes: tuple[RequestClass, ...]

    @classmethod
    def single(cls, prompt_spec: str, output_spec: str) -> Workload:
        return cls((RequestClass(1.0, LengthDist.parse(prompt_spec), LengthDist.parse(output_spec)),))

    @classmethod
    def mix(cls, class_specs: list[str]) -> Workload:
        if not class_specs:
            raise ValueError("a mix needs at least one class")
        return cls(tuple(RequestClass.parse(s) for s in class_specs))

    def sample(self, index: int, rng: np.random.Generator) -> RequestSpec:
        weights = np.array([c.weight for c in self.classes], dtype=float)
        k = int(rng.choice(len(self.classes), p=weights / weights.sum())) if len(self.classes) > 1 else 0
        cls_ = self.classes[k]
        return RequestSpec(index, cls_.prompt.sample(rng), cls_.output.sample(rng))

    def specs(self, count: int, seed: int = 0) -> list[RequestSpec]:
        rng = np.random.default_rng(seed)
        return [self.sample(i, rng) for i in range(count)]

    def __str__(self) -> str:
        return " + ".join(str(c) for c in self.classes)


def poisson_arrivals(rate: float, count: int, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of a Poisson process; the first request is at 0.

    ``rate`` is requests per second; ``math.inf`` sends everything at once.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate) or count == 0:
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def load_jsonl(path: str | Path, tokenizer=None) -> list[RequestSpec]:
    """Reads ``{"prompt": str | [ids], "max_tokens" | "output_len": int}`` lines.

    Prompt lengths are counted with ``tokenizer`` when given (0 otherwise).
    """
    specs = []
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt = obj["prompt"]
                output_len = int(obj.get("max_tokens", obj.get("output_len", 0)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: bad line ({exc}); need prompt and max_tokens") from None
            if not isinstance(prompt, (str, list)) or output_len < 1:
                raise ValueError(f"{path}:{lineno}: prompt must be a string or token list, max_tokens >= 1")
            if isinstance(prompt, list):
                prompt_len = len(prompt)
            elif tokenizer is not None:
                prompt_len = len(tokenizer.encode(prompt))
            else:
                prompt_len = 0
            specs.append(RequestSpec(len(specs), prompt_len, output_len, prompt))
    if not specs:
        raise ValueError(f"{path}: no requests")
    return specs


def _split_top_level(text: str, sep: str) -> list[str]:
    """Splits on ``sep`` outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]
