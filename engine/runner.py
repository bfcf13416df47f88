"""Model runner: a schedule plan in, sampled tokens out. Knows no HTTP, no queues.

The model returns logits only for the rows asked for: each sampling chunk's
last row and, for a request asking for prompt log-probabilities, every row of
its prompt chunks (engine/model.py ``logits_rows``), so the prompt's
log-probabilities come from the same pass that computes its KV.

A step is turned into plain ``StepInputs`` (token ids, positions, slots, block
tables) first, then ``forward`` runs the model on them. In a tensor-parallel
engine rank 0 sends the same inputs to the other ranks before its own
``forward`` (engine/tp_leader.py); they run ``forward`` on their shards
(engine/tp_worker.py), and rank 0 alone samples from the gathered logits.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine import native
from engine.attention import AttentionMetadata, DecodeGroup, PrefillBatch, PrefillSpan, decode_groups
from engine.config import AttentionBackend
from engine.decode_graphs import DecodeGraphs
from engine.grammar_mask import apply_grammar_masks
from engine.kv_cache import KVCache
from engine.model import CausalLM, rope_kinds
from engine.request import ChunkResult, Logprob, Request
from engine.sampler import sample, top_logprobs
from engine.scheduler import ScheduledChunk, SchedulePlan
from engine.tp_wire import StepInputs

log = logging.getLogger(__name__)


class RankDriver(Protocol):
    """Rank 0's link to the other ranks of a tensor-parallel engine (engine/tp_leader.py)."""

    def send_step(self, inputs: StepInputs) -> None: ...


@dataclass(frozen=True)
class AttentionKernels:
    """The kernels a runner's attention calls beside torch's ops (engine/attention.py)."""

    decode: Callable | None = None  # reads each decode row's context in place through its block table
    prefill: Callable | None = None  # every prefill chunk of a step in one call
    fused_decode: bool = False  # decode is engine.native's: a decode step may run as its DecodeLayer
    windows: bool = False  # decode takes a sliding window (else windowed layers decode with torch's ops)
    name: str = "torch"


def attention_kernels(backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> AttentionKernels:
    """What ``attention_backend`` means on ``device``. auto: Triton's kernels on CUDA where Triton imports,
    engine.native's decode attention (and DecodeLayer) on CPU where it is built, else torch's ops. torch:
    torch's ops alone. triton: Triton's kernels; on a CPU they run only under Triton's own interpreter
    (``TRITON_INTERPRET=1``, which Triton reads), for tests."""
    if backend == "auto" and device.type == "cuda":
        if importlib.util.find_spec("triton") is not None:
            backend = "triton"
        else:
            log.warning("attention on CUDA with torch's ops: Triton is not installed")
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention_backend 'triton' needs a CUDA device, not {device.type!r} "
                "(on CPU it runs only under Triton's interpreter, TRITON_INTERPRET=1)"
            )
        from engine import triton_attention

        return AttentionKernels(
            triton_attention.decode_attention, triton_attention.prefill_attention, windows=True, name="triton"
        )
    if backend == "auto" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        decode = native.kernel("decode_attention")
        if decode is not None:
            return AttentionKernels(decode, fused_decode=True, name="native")
    return AttentionKernels()


class RoPE:
    """cos and signed sin tables for every position up to the context length, built once: one table per
    entry of ``engine.model.rope_kinds``, stacked, [tables, max_len, head_dim].

    ``sin_signed`` is sin with the first half of every row negated, the form
    ``engine.model.rotate`` multiplies by."""

    def __init__(self, hf_config, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        kinds = rope_kinds(hf_config)
        tables = [self._table(hf_config, kind, head_dim, max_len) for kind in kinds]
        self.cos = torch.stack([cos for cos, _ in tables]).to(dtype=dtype, device=device)
        sin = torch.stack([sin for _, sin in tables]).to(dtype=dtype, device=device)
        half = head_dim // 2
        self.sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    @staticmethod
    def _table(hf_config, kind: str | None, head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        params = getattr(hf_config, "rope_parameters", None) or {}
        if kind is not None:
            params = params[kind]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            extra = {} if kind is None else {"layer_type": kind}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scaling, emb.sin() * scaling


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        rope: RoPE,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        ranks: RankDriver | None = None,
        attention_backend: AttentionBackend = "auto",
    ) -> None:
        self.model = model
        self.ranks = ranks  # rank 0 of a tensor-parallel engine: sends each step to the other ranks
        self._pending_copies: list[tuple[int, int]] = []  # block copies the other ranks make next step
        self.eos_token_ids = eos_token_ids  # masked while a request's min_tokens are not reached
        self.cache = cache
        self.rope = rope
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.seed()
        self.kernels = attention_kernels(attention_backend, device, cache.kv.dtype)
        if model.latent and self.kernels.name != "torch":
            # latent attention runs on torch's ops alone (engine/mla.py): its decodes are padded into groups
            # with the runner's masks, its prefill chunks are spans
            log.info("latent attention: torch's ops, not %s's kernels", self.kernels.name)
            self.kernels = AttentionKernels()
        self.graphs: DecodeGraphs | None = None  # decode-only steps as CUDA graphs (use_decode_graphs)

    def use_decode_graphs(self, max_model_len: int, max_num_seqs: int, capture: bool = True) -> None:
        """Runs decode-only steps from padded static buffers, captured as CUDA graphs (engine/decode_graphs.py);
        ``capture=False`` runs the same buffers eagerly (tests on CPU)."""
        if capture and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, not {self.device.type!r}")
        if self.ranks is not None:
            raise ValueError("cuda_graphs needs tensor_parallel_size 1 (collectives are not captured)")
        if self.model.latent:
            raise ValueError("cuda_graphs is not supported with latent attention (a config with kv_lora_rank)")
        if self.kernels.decode is None:
            raise ValueError(
                "cuda_graphs needs a decode kernel that reads the cache in place (attention_backend triton)"
            )
        self.graphs = DecodeGraphs(
            self.model,
            self.cache.kv,
            self.rope.cos,
            self.rope.sin_signed,
            self.kernels.decode,
            self.kernels.windows,
            self.cache.order == "HND",
            self.cache.block_size,
            max_model_len,
            max_num_seqs,
            capture,
        )

    @torch.inference_mode()
    def run(self, plan: SchedulePlan, on_layer: Callable[[int], None] | None = None) -> dict[Request, ChunkResult]:
        """Computes every chunk of the plan; returns what each sampling chunk drew and
        each chunk of a request asking for prompt log-probabilities gave."""
        bs = self.cache.block_size
        # Decodes first, shortest context first (decode groups are runs of similar length).
        chunks = sorted(plan.chunks, key=lambda c: (c.num_tokens != 1, c.start if c.num_tokens == 1 else 0))
        num_decodes = sum(1 for c in chunks if c.num_tokens == 1)
        pooled = self.cache.window_kv is not None  # window layers have their own blocks (engine/window_pool.py)
        inputs = StepInputs(copies=self._pending_copies)
        self._pending_copies = []
        sampled: list[tuple[ScheduledChunk, int]] = []  # (chunk, its row of logits)
        prompt_rows: list[tuple[ScheduledChunk, int, int]] = []  # (chunk, first row of logits, count)
        for chunk in chunks:
            request, start, n = chunk.request, chunk.start, chunk.num_tokens
            row = len(inputs.token_ids)
            inputs.token_ids += request.token_ids(start, start + n)
            inputs.positions += range(start, start + n)
            table = request.block_ids
            inputs.slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if n != 1:
                inputs.prefills.append((row, n, start, table[: -(-(start + n) // bs)]))
            if pooled:
                table = request.window_block_ids
                inputs.window_slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
                if n != 1:
                    inputs.window_prefills.append((row, n, start, table[: -(-(start + n) // bs)]))
            if request.wants_prompt_logprobs:  # every row but the sampled one predicts a prompt token
                count = n - 1 if chunk.sample else n
                prompt_rows.append((chunk, len(inputs.logits_rows), count))
                inputs.logits_rows += range(row, row + count)
            if chunk.sample:
                sampled.append((chunk, len(inputs.logits_rows)))
                inputs.logits_rows.append(row + n - 1)
        if num_decodes:
            inputs.decodes = self._decode_groups(chunks[:num_decodes])
            if pooled:
                inputs.window_decodes = self._decode_groups(chunks[:num_decodes], window=True)
        if self.ranks is not None:
            self.ranks.send_step(inputs)  # the other ranks compute their shards of the same step
        logits = self.forward(inputs, on_layer)
        assert logits is not None  # rank 0 holds the gathered logits
        results: dict[Request, ChunkResult] = {}
        prompt = self._prompt_logprobs(logits, prompt_rows) if prompt_rows else {}
        if sampled:
            picks = logits[[r for _, r in sampled]] if prompt_rows else logits
            apply_grammar_masks(picks, [c.request.grammar for c, _ in sampled])
            draws = sample(picks, [c.request for c, _ in sampled], self.generator, self.eos_token_ids)
            for (chunk, _), (tokens, logprobs) in zip(sampled, draws):
                results[chunk.request] = ChunkResult(tokens, logprobs, prompt.pop(chunk.request, None))
        for request, entries in prompt.items():
            results[request] = ChunkResult(prompt_logprobs=entries)
        return results

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies blocks in this rank's cache now, and in the other ranks' before their next step."""
        self.cache.copy_blocks(pairs)
        if self.ranks is not None:
            self._pending_copies += pairs

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, on_layer: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """The model over one step's inputs, on this rank's shard: logits of ``inputs.logits_rows``
        (None on a rank other than 0). Every rank of a tensor-parallel engine calls it with the same
        inputs; ``inputs.copies`` are made first (rank 0 made them when they were queued)."""
        device = self.device
        if inputs.copies and self.ranks is None:
            self.cache.copy_blocks(inputs.copies)
        if self.graphs is not None and on_layer is None and self.graphs.fits(inputs):
            return self.graphs.run(inputs)
        meta = self._metadata(inputs.slots, inputs.prefills, inputs.decodes)
        if inputs.window_slots:  # the window layers' blocks are a window pool's (engine/window_pool.py)
            meta.window = self._metadata(inputs.window_slots, inputs.window_prefills, inputs.window_decodes)
        pos = torch.tensor(inputs.positions, dtype=torch.long, device=device)
        cos = self.rope.cos.index_select(1, pos).unsqueeze(2)  # [tables, tokens, 1, head_dim]
        sin_signed = self.rope.sin_signed.index_select(1, pos).unsqueeze(2)
        ids = torch.tensor(inputs.token_ids, dtype=torch.long, device=device)
        rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=device)
        return self.model(ids, cos, sin_signed, self.cache.layers, meta, rows, on_layer)

    def _metadata(
        self,
        slots: list[int],
        spans: list[tuple[int, int, int, list[int]]],
        groups: list[tuple[int, list[int], list[list[int]]]],
    ) -> AttentionMetadata:
        """Attention's view of a step over one block table: each token's slot, the prefill chunks (row,
        length, cached tokens before it, blocks) and the decode groups (first row, lengths, table)."""
        device = self.device
        prefills: list[PrefillSpan] = []
        prefill_batch = None
        if self.kernels.prefill is not None and spans:
            prefill_batch = self._prefill_batch(spans)
        else:
            prefills = [
                PrefillSpan(row, n, start, torch.tensor(blocks, dtype=torch.long, device=device))
                for row, n, start, blocks in spans
            ]
        bs = self.cache.block_size
        decodes = []
        for start, lengths, table in groups:
            lens = torch.tensor(lengths, dtype=torch.long, device=device)
            blocks = torch.tensor(table, dtype=torch.long, device=device)
            mask = None  # the native kernel reads each row's own length
            if self.kernels.decode is None:
                # Additive, in the cache's dtype: attention adds it as it is in every layer, where a
                # boolean mask would be converted to this once per layer.
                span = torch.arange(len(table[0]) * bs, device=device)
                padding = span[None, :] >= lens[:, None]
                mask = torch.zeros(padding.shape, dtype=self.cache.kv.dtype, device=device)
                mask.masked_fill_(padding, -torch.inf)
                mask = mask[:, None, None, :]
            decodes.append(DecodeGroup(start, len(lengths), blocks, lens, mask))
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decodes=sum(len(lengths) for _, lengths, _ in groups),
            decodes=decodes,
            prefills=prefills,
            hnd=self.cache.order == "HND",
            decode_kernel=self.kernels.decode,
            fused_decode=self.kernels.fused_decode,
            decode_windows=self.kernels.windows,
            prefill_kernel=self.kernels.prefill,
            prefill_batch=prefill_batch,
        )

    def _prefill_batch(self, spans: list[tuple[int, int, int, list[int]]]) -> PrefillBatch:
        """The step's prefill chunks (row, length, cached tokens before it, blocks) as one kernel's input."""
        count, width = len(spans), max(len(blocks) for *_, blocks in spans)
        flat = [row for row, *_ in spans] + [n for _, n, *_ in spans] + [start for _, _, start, _ in spans]
        for *_, blocks in spans:
            flat += blocks + [0] * (width - len(blocks))
        data = torch.tensor(flat, dtype=torch.long).to(self.device)  # one copy to the device for the batch
        return PrefillBatch(
            query_starts=data[:count],
            query_lens=data[count : 2 * count],
            context_starts=data[2 * count : 3 * count],
            block_table=data[3 * count :].view(count, width),
            max_query_len=max(n for _, n, _, _ in spans),
        )

    def _prompt_logprobs(
        self, logits: torch.Tensor, prompt_rows: list[tuple[ScheduledChunk, int, int]]
    ) -> dict[Request, list[Logprob | None]]:
        """The raw model's log-probabilities of the prompt tokens the chunks' rows predict."""
        rows = [r for _, first, count in prompt_rows for r in range(first, first + count)]
        targets = [t for c, _, count in prompt_rows for t in c.request.token_ids(c.start + 1, c.start + 1 + count)]
        ks = [c.request.sampling.prompt_logprobs for c, _, count in prompt_rows for _ in range(count)]
        flat = []
        if rows:
            logprobs = torch.log_softmax(logits[rows], dim=-1)
            flat = top_logprobs(logprobs, torch.tensor(targets, dtype=torch.long, device=logits.device), ks)
        out, at = {}, 0
        for chunk, _, count in prompt_rows:
            out[chunk.request] = ([None] if chunk.start == 0 else []) + flat[at : at + count]
            at += count
        return out

    def _decode_groups(self, decodes, window: bool = False) -> list[tuple[int, list[int], list[list[int]]]]:
        """(first row, context lengths, block table padded to the longest) of each decode group. A decode
        kernel (native or Triton) reads each row's own context (no padding): all decodes are one group.
        ``window``: the tables of the window layers' blocks (engine/window_pool.py)."""
        bs = self.cache.block_size
        lengths = [c.start + 1 for c in decodes]  # sorted ascending by run()
        groups = []
        runs = [(0, len(lengths))] if self.kernels.decode is not None else decode_groups(lengths)
        for start, count in runs:
            group = lengths[start : start + count]
            max_blocks = -(-max(group) // bs)
            table = [
                (c.request.window_block_ids if window else c.request.block_ids)[: -(-n // bs)]
                for c, n in zip(decodes[start : start + count], group)
            ]
            groups.append((start, group, [t + [0] * (max_blocks - len(t)) for t in table]))
        return groups
