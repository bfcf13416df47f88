"""Cost models the simulator runs on, fitted from measured engine steps.

One engine step (any mix of prefill chunks and decode tokens) costs

    t = base + per_token * new_tokens + per_attn * attn_pairs + per_seq * seqs
        + per_key * decode_keys

* ``new_tokens``: tokens computed this step (prefill chunk tokens + one per
  decode); the linear layers scale with it.
* ``attn_pairs``: (query, key) pairs prompt attention computes
  (:func:`chunk_attn_pairs`): a chunk with nothing cached before it runs
  the causal kernel, e(e+1)/2 pairs for positions [0, e); a chunk [s, e)
  after cached tokens attends over all e keys under a mask, (e - s) * e.
  The quadratic term of long prompts.
* ``decode_keys``: keys the decode batch reads from the paged cache
  (:func:`decode_keys`): gathered block by block, each group of similar
  context lengths padded to its longest. Memory-bound, so it gets its own
  coefficient (``per_key``).
* ``seqs``: sequences that sample a token this step (the LM head and the
  sampler run once per sequence, not per prompt token).

On N tensor-parallel ranks (:func:`split_step_cost`) every term but ``base``
is divided by N (each rank computes 1/N of the heads, MLP features, vocabulary
and KV reads) and each layer adds two all-reduces of the step's hidden states,
``latency + 2 (N-1)/N * bytes / bandwidth`` each (a ring), from the profile's
all-reduce measurement.

A KV transfer of n prompt tokens takes ``latency + n * bytes_per_token /
bandwidth``; pushed layer by layer, all but the last layer's share overlaps
the prefill compute (see :meth:`TransferCost.arrival`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from engine.step_cost import StepCost, chunk_attn_pairs


def prefill_pairs(prefills: list[tuple[int, int]]) -> int:
    """Pairs one step's prompt chunks ``(start, end)`` compute."""
    return sum(chunk_attn_pairs(s, e) for s, e in prefills)


def decode_keys(contexts: list[int]) -> int:
    """Keys one decode batch reads: new tokens at positions ``contexts``, each
    group of similar lengths padded to its longest (``engine.attention.decode_groups``)."""
    from engine.attention import decode_groups

    lengths = sorted(c + 1 for c in contexts)
    return sum(count * lengths[start + count - 1] for start, count in decode_groups(lengths))


@dataclass(frozen=True)
class AllReduceCost:
    """One all-reduce of ``n`` bytes over a group: ``latency + n / bandwidth`` (bandwidth as measured at
    the group size it was measured at; :func:`split_step_cost` scales it to a ring of N)."""

    latency: float  # seconds
    bandwidth: float  # bytes per second


def split_step_cost(cost: StepCost, tp: int, allreduce: AllReduceCost, num_layers: int, hidden_bytes: int) -> StepCost:
    """The step cost on ``tp`` ranks: compute divided by ``tp`` (``base``, the per-step Python and launch
    overhead, is not), plus two all-reduces a layer of ``hidden_bytes`` per new token."""
    if tp == 1:
        return cost
    calls = 2 * num_layers
    ring = 2 * (tp - 1) / tp  # bytes each rank sends and receives per byte reduced, over the 2-rank measurement's 1
    return StepCost(
        base=cost.base + calls * allreduce.latency,
        per_token=cost.per_token / tp + calls * hidden_bytes * ring / allreduce.bandwidth,
        per_attn=cost.per_attn / tp,
        per_seq=cost.per_seq / tp,
        per_key=cost.per_key / tp,
    )


@dataclass(frozen=True)
class StepSample:
    """One measured step: its features and its wall time."""

    new_tokens: int
    attn_pairs: int
    seqs: int
    seconds: float
    decode_keys: int = 0

    @property
    def features(self) -> tuple[int, int, int, int]:
        return (self.new_tokens, self.attn_pairs, self.seqs, self.decode_keys)


def fit_step_cost(samples: list[StepSample], robust: bool = True) -> StepCost:
    """Least squares with non-negative coefficients, weighted by 1/time.

    Relative weighting keeps short decode steps as well fitted as long
    prefills. Negative coefficients are dropped and the rest refitted (an
    active-set NNLS, enough for five unknowns). ``robust``: samples far off
    the first fit (a step slowed by another process on a shared machine)
    are dropped and the rest refitted once.
    """
    if len(samples) < 4:
        raise ValueError(f"need at least 4 step samples to fit, got {len(samples)}")
    x = np.array([[1.0, *s.features] for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    coef = _nnls_relative(x, y)
    if robust:
        rel = np.abs(x @ coef - y) / np.maximum(y, 1e-9)
        keep = rel <= 3 * np.median(rel) + 0.05
        if keep.sum() >= 4 and not keep.all():
            coef = _nnls_relative(x[keep], y[keep])
    return StepCost(*(float(c) for c in coef))


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    w = 1.0 / np.maximum(y, 1e-9)
    active = [i for i in range(x.shape[1]) if x[:, i].any()]  # a feature no sample has stays 0
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit_error(cost: StepCost, samples: list[StepSample]) -> float:
    """Mean relative error of the fitted model on the samples."""
    errs = [abs(cost.step_time(*s.features) - s.seconds) / s.seconds for s in samples if s.seconds > 0]
    return float(np.mean(errs)) if errs else 0.0


@dataclass(frozen=True)
class TransferCost:
    bytes_per_token: int
    bandwidth: float  # bytes per second
    latency: float = 0.0  # seconds: completion notice, queueing
    num_layers: int = 1
    layerwise: bool = True

    def seconds(self, tokens: int) -> float:
        return self.latency + tokens * self.bytes_per_token / self.bandwidth

    def arrival(self, tokens: int, compute_start: float, compute_end: float) -> float:
        """When a prompt's KV is complete on D.

        Layer by layer, layer i's bytes can leave once layer i is computed:
        the last layer's share follows the end of compute, and the whole
        transfer cannot finish before the first layer's share started.
        """
        wire = tokens * self.bytes_per_token / self.bandwidth
        if not self.layerwise or self.num_layers <= 1:
            return compute_end + self.latency + wire
        first_layer_done = compute_start + (compute_end - compute_start) / self.num_layers
        done = max(compute_end + wire / self.num_layers, first_layer_done + wire)
        return done + self.latency

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TransferCost:
        return cls(
            int(data["bytes_per_token"]),
            float(data["bandwidth"]),
            float(data.get("latency", 0.0)),
            int(data.get("num_layers", 1)),
            bool(data.get("layerwise", True)),
        )


@dataclass(frozen=True)
class Overheads:
    """Fixed latencies outside the engines (seconds).

    ``ingress``: client to engine (HTTP, tokenization, routing);
    ``egress``: engine to client per token event; ``pd_hop``: the extra
    round trip of a disaggregated request (reservation on D, then the call
    to P) before P can start.
    """

    ingress: float = 0.0
    egress: float = 0.0
    pd_hop: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)
