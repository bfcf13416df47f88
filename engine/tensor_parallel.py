"""Which part of the model one tensor-parallel rank holds (Megatron's split).

With ``tensor_parallel_size`` N, rank r of N holds::

    attention  query heads   [r * H/N, (r+1) * H/N)        (qkv_proj rows, o_proj columns)
               KV heads      kv_heads_for_rank(KV, r, N)   (qkv_proj rows; its KV cache holds only these)
    MLP        intermediate  [r * I/N, (r+1) * I/N)        (gate_up_proj rows of gate and of up, down_proj columns)
    experts    every expert, its intermediate split as the MLP's; or with expert parallelism
               experts [r * E/N, (r+1) * E/N), whole                                      (engine/moe.py)
    lm_head    vocabulary    [r * ceil(V/N), ...)          (rows; the last shard padded with zero rows)
    everything else (embeddings, norms, q/k norms) whole

Each decoder layer sums the ranks' partial outputs twice, after ``o_proj`` and
after ``down_proj`` (one all-reduce each); a bias of those projections is added
by rank 0 alone. The logits' vocabulary slices are gathered on rank 0, which
samples. With more ranks than KV heads each KV head is replicated on
N / KV ranks (rank r holds head r * KV // N) and each rank's query heads are
the ones that read that head (vLLM's split). This is the one place the
split is written: a rank's cache reports its heads (``KVCache.head_ids``)
and the KV transfer takes them from there.
"""

from __future__ import annotations

from dataclasses import dataclass


def kv_heads_for_rank(num_kv_heads: int, rank: int, size: int) -> tuple[int, ...]:
    """Global KV head ids rank ``rank`` of ``size`` holds, in local order."""
    assert 0 <= rank < size, (rank, size)
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return tuple(range(rank * per, (rank + 1) * per))
    return (rank * num_kv_heads // size,)


def split_problem(num_heads: int, num_kv_heads: int, intermediate: int, size: int) -> str | None:
    """Why a model with these sizes cannot be split over ``size`` ranks; None when it can."""
    if num_heads % size:
        return f"{num_heads} attention heads cannot be split evenly over tensor_parallel_size={size}"
    if num_kv_heads >= size and num_kv_heads % size:
        return f"{num_kv_heads} KV heads cannot be split evenly over tensor_parallel_size={size}"
    if num_kv_heads < size and size % num_kv_heads:
        return f"tensor_parallel_size={size} is not a multiple of the model's {num_kv_heads} KV heads"
    if intermediate % size:
        return f"the MLP's {intermediate} intermediate features cannot be split evenly over tensor_parallel_size={size}"
    return None


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: the slices of the model's dimensions it holds."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # experts split whole over the ranks, not each expert's features

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, (self.rank, self.size)

    @property
    def whole(self) -> bool:
        return self.size == 1

    def q_heads(self, num_heads: int) -> range:
        per = num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> tuple[int, ...]:
        return kv_heads_for_rank(num_kv_heads, self.rank, self.size)

    def intermediate(self, intermediate: int) -> range:
        per = intermediate // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        if not self.expert_parallel:
            return range(num_experts)
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def expert_intermediate(self, intermediate: int) -> range:
        """The features of each of its experts this rank holds."""
        return range(intermediate) if self.expert_parallel else self.intermediate(intermediate)

    def vocab_rows(self, vocab: int) -> int:
        """Rows of every rank's lm_head slice (the last one padded)."""
        return -(-vocab // self.size)

    def vocab(self, vocab: int) -> range:
        """The vocabulary ids this rank computes logits for (the last slice may be short)."""
        per = self.vocab_rows(vocab)
        return range(min(self.rank * per, vocab), min((self.rank + 1) * per, vocab))
