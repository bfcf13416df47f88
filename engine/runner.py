"""Model runner: a schedule plan in, sampled tokens out. Knows no HTTP, no queues."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, DecodeGroup, PrefillSpan, decode_groups
from engine.grammar_mask import apply_grammar_masks
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sampler import sample
from engine.scheduler import SchedulePlan


class RoPE:
    """cos/sin tables for every position up to the context length, built once."""

    def __init__(self, hf_config, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scaling).to(dtype=dtype, device=device)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, rope: RoPE, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.rope = rope
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.seed()

    @torch.inference_mode()
    def run(self, plan: SchedulePlan, on_layer: Callable[[int], None] | None = None) -> dict[str, int]:
        """Computes every chunk of the plan; returns the sampled token per sampling request."""
        bs = self.cache.block_size
        # Decodes first, shortest context first (decode groups are runs of similar length).
        chunks = sorted(plan.chunks, key=lambda c: (c.num_tokens != 1, c.start if c.num_tokens == 1 else 0))
        num_decodes = sum(1 for c in chunks if c.num_tokens == 1)
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        logits_rows: list[int] = []
        for chunk in chunks:
            request, start, n = chunk.request, chunk.start, chunk.num_tokens
            row = len(token_ids)
            token_ids += request.token_ids(start, start + n)
            positions += range(start, start + n)
            table = request.block_ids
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if n != 1:
                blocks = torch.tensor(table[: -(-(start + n) // bs)], dtype=torch.long, device=self.device)
                prefills.append(PrefillSpan(row, n, start, blocks))
            if chunk.sample:
                logits_rows.append(row + n - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=num_decodes,
            decodes=[],
            prefills=prefills,
            hnd=self.cache.order == "HND",
        )
        if num_decodes:
            self._decode_tables(chunks[:num_decodes], meta)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        cos = self.rope.cos.index_select(0, pos).unsqueeze(1)
        sin = self.rope.sin.index_select(0, pos).unsqueeze(1)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        logits = self.model(ids, cos, sin, self.cache.kv, meta, rows, on_layer)
        sampled = [c for c in chunks if c.sample]
        apply_grammar_masks(logits, [c.request.grammar for c in sampled])
        tokens = sample(
            logits,
            [c.request.sampling for c in sampled],
            [len(c.request.output_token_ids) for c in sampled],
            self.generator,
        )
        return {c.request.request_id: t for c, t in zip(sampled, tokens)}

    def _decode_tables(self, decodes, meta: AttentionMetadata) -> None:
        bs = self.cache.block_size
        lengths = [c.start + 1 for c in decodes]  # sorted ascending by run()
        for start, count in decode_groups(lengths):
            group = lengths[start:start + count]
            max_blocks = -(-max(group) // bs)
            table = [c.request.block_ids[: -(-n // bs)] for c, n in zip(decodes[start:start + count], group)]
            table = [t + [0] * (max_blocks - len(t)) for t in table]
            span = torch.arange(max_blocks * bs, device=self.device)
            lens = torch.tensor(group, device=self.device)
            meta.decodes.append(DecodeGroup(start, count, torch.tensor(table, dtype=torch.long, device=self.device),
                                            (span[None, :] < lens[:, None])[:, None, None, :]))
