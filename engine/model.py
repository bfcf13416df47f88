"""Llama / Qwen3 / Qwen2 decoder in plain torch, reading and writing a paged KV cache.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are
fused into one matmul each (``engine.loader`` concatenates them on load):
fewer, larger matmuls are markedly faster on CPU. On CPU every projection's
weight is then laid out for the kernel that reads it fastest
(:meth:`Linear.pack_for_cpu`, called by the loader).

Under tensor parallelism (engine/tensor_parallel.py) each rank builds the
model with its ``Shard``'s slice of heads, MLP features and vocabulary, and a
``RankGroup`` that sums the partial outputs of ``o_proj`` and ``down_proj``
over the ranks and gathers the logits on rank 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import yarn_apply_mscale

from engine import native
from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.mla import latent_attention, latent_width, write_latent
from engine.moe import MoE, MoESpec
from engine.row_buckets import packed_linear
from engine.tensor_parallel import Shard


class RankGroup(Protocol):
    """The collectives a sharded model needs; every rank calls each in the same order."""

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sums ``x`` over the ranks, in place."""
        ...

    def gather_logits(self, part: torch.Tensor) -> torch.Tensor | None:
        """Every rank's [rows, vocab slice] side by side on rank 0; None on the others."""
        ...


class RMSNorm(nn.Module):
    """Same arithmetic as Hugging Face's: normalise in float32, scale in the model dtype.

    ``F.rms_norm`` is one call where the spelled-out form is five, with the same result bit
    for bit (tests/engine/test_layers.py)."""

    native: Callable | None = None  # engine.native's kernel for this norm's dtype on CPU

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        """``offset``: Gemma's norm, which scales by ``1 + weight`` in float32 and rounds after the scale."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)
        self.offset = offset

    def use_cpu_kernel(self) -> None:
        """On CPU, where engine.native is built, a bfloat16 norm runs as its one-pass kernel: the same
        arithmetic, its float32 sum of squares in another order. A float32 norm runs as its
        ``rms_norm_f32``: torch's arithmetic bit for bit (its sum of squares is torch's sum) in two
        calls where torch's composite makes six."""
        if self.offset:
            return
        if self.weight.device.type == "cpu" and self.weight.dtype in (torch.bfloat16, torch.float32):
            self.native = native.kernel("rms_norm_bf16" if self.weight.dtype == torch.bfloat16 else "rms_norm_f32")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == self.weight.dtype:
            return self.native(x, self.weight, self.eps)
        if self.offset:
            return (F.rms_norm(x.float(), self.shape, eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)


@dataclass(frozen=True)
class Flavor:
    """What a family changes in the decoder layer's shape (Gemma 3's, besides the Llama-like default)."""

    norm_offset: bool = False  # every norm scales by 1 + weight (:class:`RMSNorm`)
    sandwich: bool = False  # norms after attention and around the MLP as well as before attention
    gelu: bool = False  # the MLP's gate through tanh-approximated GELU, not SiLU
    embed_scale: float | None = None  # embeddings multiplied by this (rounded to the model dtype)
    attn_scale: float | None = None  # attention's scale; None: head_dim ** -0.5
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    @classmethod
    def of(cls, cfg) -> Flavor:
        if cfg.model_type != "gemma3_text":
            return cls()
        return cls(
            norm_offset=True,
            sandwich=True,
            gelu=True,
            embed_scale=cfg.hidden_size**0.5,
            attn_scale=cfg.query_pre_attn_scalar**-0.5,
            final_softcap=cfg.final_logit_softcapping,
        )


def rope_kinds(hf_config) -> tuple[str | None, ...]:
    """The RoPE tables a model needs: one (None) for most models; one per layer type where
    ``rope_parameters`` is keyed by them (Gemma 3: its sliding layers' base, its global layers')."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    types = getattr(hf_config, "layer_types", None)
    if types is None or not all(kind in params for kind in types):
        return (None,)
    return tuple(sorted(set(types)))


def rope_tables(hf_config) -> tuple[tuple[str | None, ...], list[int]]:
    """:func:`rope_kinds`, and the index of each layer's among them."""
    kinds = rope_kinds(hf_config)
    if kinds == (None,):
        return kinds, [0] * hf_config.num_hidden_layers
    return kinds, [kinds.index(kind) for kind in hf_config.layer_types]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [tokens, heads, dim]: ``x * cos + rotate_half(x) * sin``.

    ``rotate_half(x) * sin`` is ``roll(x, dim / 2) * sin_signed``, where ``sin_signed`` is sin with
    its first half negated: one roll instead of a negation, two slices and a concatenation, and
    the same numbers bit for bit (negating a factor of a product is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


F32_WEIGHT_COPIES = "PDSERVE_F32_WEIGHT_COPIES"  # 1 or 2: how a float32 projection is held on CPU (Linear)
F32_WEIGHT_COPIES_DEFAULT = 2  # one copy costs prefill ~4 % (Linear)


def float32_weight_copies() -> int:
    """How many copies of each float32 projection :meth:`Linear.pack_for_cpu` keeps on CPU: 1, its input-major
    weight alone, or 2, a oneDNN-packed copy beside it for many rows (``PDSERVE_F32_WEIGHT_COPIES``)."""
    value = os.environ.get(F32_WEIGHT_COPIES, str(F32_WEIGHT_COPIES_DEFAULT))
    if value not in ("1", "2"):
        raise ValueError(f"{F32_WEIGHT_COPIES} must be 1 or 2, not {value!r}")
    return int(value)


def cpu_weight_copies(dtype: torch.dtype) -> int:
    """How many times a CPU rank holds each projection's weight in ``dtype`` (:meth:`Linear.pack_for_cpu`):
    bfloat16 twice (the packed copy and the plain weight its few-row kernel reads), float32
    :func:`float32_weight_copies`, any other dtype once (plain ``F.linear``)."""
    if dtype == torch.bfloat16:
        return 2
    if dtype == torch.float32:
        return float32_weight_copies()
    return 1


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be laid out for the CPU's matmul kernels.

    Until :meth:`pack_for_cpu` it is plain ``F.linear``. After it:

    - bfloat16: a oneDNN-packed copy of the weight serves many rows; it is what makes a
      bfloat16 step faster than a float32 one. Up to ``FEW_ROWS[bfloat16]`` rows (decode steps
      of a few sequences) go to ``engine.native``'s ``gemv_bf16`` over the plain weight, where
      this CPU has it (it reads each weight once for all of them: a decode step of one sequence
      1.16x faster than on the packed matmul, of two 1.24x, of three 1.09x; at four the packed
      matmul is as fast), else to the packed copy too;
    - float32: the weight becomes a transposed view of an input-major [in, out] tensor. Up to
      ``FEW_ROWS[float32]`` rows go to ``engine.native``'s ``gemv_f32``, which streams that
      tensor at memory speed for one to eight rows; without it, one row goes to torch's matmul
      (which streams that layout fastest). More rows (prefill, and without ``gemv_f32`` from
      ``packed_min_rows``) go to oneDNN's matmul (torch's, MKL's, is over 2x slower on AVX-512 in
      either layout: bench/micro/f32_layouts.py), over a oneDNN-packed copy: the projections held
      twice; on a CPU with AVX2 and no AVX-512, ``MKL_MIN_ROWS`` rows and more go to torch's matmul
      over the input-major tensor, faster there. With ``PDSERVE_F32_WEIGHT_COPIES=1``
      (:func:`float32_weight_copies`) they are held once: oneDNN reads the input-major tensor in
      place (``packed`` is that view), a 0.5B model's resident memory 1.8 GB less, its prefill
      about 4 % slower and decode steps of 9 to 16 sequences up to 10 % (gate_up, wide, loses
      most: 6 to 15 % at 16 to 2048 rows; steps of up to eight sequences are gemv_f32's either
      way; bench/micro/f32_copies.py).

    ``weight`` keeps its [out, in] shape and values either way, so reading or sharding it
    elsewhere is unchanged.
    """

    packed_min_rows = 2
    FEW_ROWS = {torch.bfloat16: 3, torch.float32: 8}  # the most rows the native kernel of each dtype serves
    few_rows_max = 0

    packed: torch.Tensor | None = None
    packed_all = False  # the packed copy serves every batch size
    # float32 on a CPU whose best vectors are AVX2 (no AVX-512): this many rows and more (prefill chunks) go to
    # torch's matmul (MKL) over the input-major weight, which computes them faster there than oneDNN's packed
    # copy (a 1027-token prefill of SmolLM2 1.21x as fast, 2050 tokens 1.07x, one thread's CPU time; a closed loop
    # of long prompts: bench/micro/long_prompts.py); on AVX-512 oneDNN's is the faster one (f32_layouts.py). Not
    # the lm_head (its rows are a step's sampled ones).
    MKL_MIN_ROWS = 512
    MKL_MAX_OUT = 16384
    mkl_min_rows = 0  # 0: none
    few_rows: Callable | None = None  # the native kernel for up to few_rows_max rows
    rows: torch.Tensor | None = None  # a tied lm_head's embedding rows, read by rows_kernel (read_rows)
    rows_kernel: Callable | None = None

    def pack_for_cpu(self) -> None:
        weight = self.weight.detach()
        if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return
        if weight.dtype not in (torch.bfloat16, torch.float32):
            return
        if weight.dtype == torch.bfloat16:
            # oneDNN packs bfloat16 only where the CPU converts it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); on an
            # AVX2 CPU its reorder raises, and torch's own bfloat16 matmul serves every row count instead
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
                self.packed_all = True
            if weight.is_contiguous():
                self.few_rows = native.kernel("gemv_bf16")
        if weight.dtype == torch.float32:  # input-major, for gemv_f32 or the one-row matmul
            if float32_weight_copies() == 2 and self.rows_kernel is None:  # read_rows: none for many rows
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            self.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
            if self.packed is None:  # one copy: oneDNN reads the input-major tensor in place
                self.packed = self.weight.detach()
            self.few_rows = native.kernel("gemv_f32")
            if torch.backends.cpu.get_cpu_capability() == "AVX2" and self.out_features <= self.MKL_MAX_OUT:
                self.mkl_min_rows = self.MKL_MIN_ROWS
        if self.few_rows is not None:
            self.few_rows_max = self.FEW_ROWS[weight.dtype]

    def read_rows(self, rows: torch.Tensor) -> bool:
        """A float32 lm_head tied to the embedding ``rows`` ([vocab, hidden], contiguous), on a CPU where
        engine.native's ``logits_f32`` is built (AVX2 and FMA) and its ``gemv_f32`` is not: 2 to
        ``FEW_ROWS[float32]`` rows (decode steps of a few sequences) go to that kernel over the embedding
        itself, which reads each row once for all of them (at 8 rows 1.3x faster than oneDNN's packed copy:
        bench/micro/decode_step.py ``--lm-head``), and no oneDNN-packed copy is kept; one row stays torch's
        matmul over the input-major copy (which streams it at memory speed), more than eight oneDNN reading
        that copy in place. Call before :meth:`pack_for_cpu`. False where it does not apply."""
        weight = self.weight.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or self.bias is not None:
            return False
        if rows.dtype != torch.float32 or rows.shape != weight.shape or not rows.is_contiguous():
            return False
        kernel = native.kernel("logits_f32")
        if kernel is None or native.kernel("gemv_f32") is not None:
            return False
        self.rows, self.rows_kernel = rows, kernel
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None and 1 < x.shape[0] <= self.FEW_ROWS[torch.float32]:
            return self.rows_kernel(x, self.rows)
        if self.few_rows is not None and 0 < x.shape[0] <= self.few_rows_max:
            return self.few_rows(x, self.weight, self.bias)
        if self.mkl_min_rows and x.shape[0] >= self.mkl_min_rows:
            return F.linear(x, self.weight, self.bias)
        if self.packed is not None and (self.packed_all or x.shape[0] >= self.packed_min_rows):
            return packed_linear(x, self.packed, self.bias)  # rows padded to a few sizes (engine/row_buckets.py)
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(
        self,
        cfg,
        head_dim: int,
        qk_norm: bool,
        bias: bool,
        shard: Shard,
        window: int | None = None,
        flavor: Flavor = Flavor(),
    ) -> None:
        """``window``: sliding-window attention over the last that many tokens (engine/attention.py)."""
        super().__init__()
        self.window = window
        self.num_heads = len(shard.q_heads(cfg.num_attention_heads))
        self.num_kv_heads = len(shard.kv_heads(cfg.num_key_value_heads))
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = flavor.attn_scale or head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, flavor.norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, flavor.norm_offset) if qk_norm else None

    def forward(self, x, cos, sin_signed, cache_layer, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # q and k side by side in qkv: rotated together
            qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = rotate(qk, cos, sin_signed).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(n, self.num_kv_heads, self.head_dim))
            q, k = rotate(q, cos, sin_signed), rotate(k, cos, sin_signed)
        if self.window is not None and meta.window is not None:
            meta = meta.window  # its blocks are the window pool's (engine/window_pool.py)
        write_kv(cache_layer, k, v, meta)
        out = paged_attention(q, k, v, cache_layer, meta, self.scale, self.window)
        return self.o_proj(out.view(n, self.q_size))


class LatentAttention(nn.Module):
    """DeepSeek-V2/V3's multi-head latent attention (engine/mla.py): the query through ``q_a_proj``,
    ``q_a_layernorm`` and ``q_b_proj`` (or one ``q_proj`` where ``q_lora_rank`` is None), the latent from
    ``kv_a_proj_with_mqa``; RoPE on the query's and the key's last ``qk_rope_head_dim`` values only.

    DeepSeek's checkpoints interleave RoPE's pairs (``rope_interleave``); the loader permutes those rows
    of the weights to rotate-half's order (engine/loader.py), so :func:`rotate` computes transformers'
    rotation, and the cached ``k_rope`` is in that order."""

    window = None  # no sliding window

    def __init__(self, cfg, shard: Shard, bias: bool) -> None:
        super().__init__()
        self.num_heads = len(shard.q_heads(cfg.num_attention_heads))
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        hidden, heads = cfg.hidden_size, self.num_heads
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.q_proj = Linear(hidden, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=bias)
        self.scale = yarn_apply_mscale(cfg.rope_parameters or {}, qk**-0.5)  # YaRN's mscale in the softmax's scale

    def forward(self, x, cos, sin_signed, cache_layer, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = q.view(n, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c.contiguous()), rotate(k_rope[:, None], cos, sin_signed)[:, 0]), -1)
        write_latent(cache_layer, latent, meta)
        out = latent_attention(
            q_nope, rotate(q_rope, cos, sin_signed), latent, cache_layer, meta,
            self.kv_b_proj, self.kv_b_proj.weight, self.scale,
        )  # fmt: skip
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, gelu: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gelu = gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    # engine.native's DecodeLayer over this layer's weights: the whole layer in one call for a step of decode
    # rows only, on CPU (the same numbers as the ops below, bit for bit)
    fused: Callable | None = None

    def __init__(
        self,
        cfg,
        head_dim: int,
        qk_norm: bool,
        bias: bool,
        shard: Shard,
        group: RankGroup | None,
        experts: MoESpec | None = None,
        window: int | None = None,
        flavor: Flavor = Flavor(),
        rope_index: int = 0,
    ) -> None:
        """``experts``: this layer's MLP is a mixture of experts (engine/moe.py); None: a dense MLP.
        ``window``: its attention is over the last that many tokens (sliding window); None: all of them.
        ``rope_index``: which of the model's RoPE tables it rotates with (engine/runner.py ``RoPE``)."""
        super().__init__()
        self.group = group
        self.rope_index = rope_index
        self.sandwich = flavor.sandwich
        hidden, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, flavor.norm_offset
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.self_attn: Attention | LatentAttention
        if latent_width(cfg) is not None:
            self.self_attn = LatentAttention(cfg, shard, bias)
        else:
            self.self_attn = Attention(cfg, head_dim, qk_norm, bias, shard, window, flavor)
        # Llama's norm before the MLP; with sandwich norms (Gemma 3) the norm of the attention's output
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        if flavor.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        self.mlp: MLP | MoE
        if experts is None:
            intermediate = len(shard.intermediate(cfg.intermediate_size))
            self.mlp = MLP(hidden, intermediate, bias=getattr(cfg, "mlp_bias", False), gelu=flavor.gelu)
        else:
            self.mlp = MoE(
                cfg.hidden_size,
                len(shard.expert_intermediate(experts.intermediate)),
                experts.num_experts,
                experts.top_k,
                experts.normalize,
                shard.experts(experts.num_experts),
                experts.weights_in_model_dtype,
                experts.routing,
                # shared experts: a dense MLP, its features split over the ranks (with expert parallelism too)
                MLP(hidden, len(shard.intermediate(experts.shared_intermediate)))
                if experts.shared_intermediate
                else None,
            )

    def use_cpu_kernel(self) -> None:
        """A float32 or bfloat16 layer on CPU, whole (not sharded), runs a step of decode rows only as
        engine.native's DecodeLayer where it is built. Called once its projections are packed: the layer
        projects as :class:`Linear` does, with the same weights and packed copies."""
        attn, mlp = self.self_attn, self.mlp
        kinds = {(p.device.type, p.dtype) for p in self.parameters()}
        if self.group is not None or kinds not in ({("cpu", torch.float32)}, {("cpu", torch.bfloat16)}):
            return
        if not isinstance(mlp, MLP) or not isinstance(attn, Attention) or attn.window is not None:
            return  # experts, latent attention and windows run as torch ops
        if self.sandwich or mlp.gelu:
            return  # so does Gemma's layer
        layer = native.kernel("DecodeLayer")
        if layer is None:
            return
        packed = [attn.qkv_proj.packed, attn.o_proj.packed, mlp.gate_up_proj.packed, mlp.down_proj.packed]
        self.fused = layer(
            input_norm=self.input_layernorm.weight.detach(),
            qkv=attn.qkv_proj.weight.detach(),
            qkv_bias=_detached(attn.qkv_proj.bias),
            q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach(),
            k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach(),
            o=attn.o_proj.weight.detach(),
            post_norm=self.post_attention_layernorm.weight.detach(),
            gate_up=mlp.gate_up_proj.weight.detach(),
            gate_up_bias=_detached(mlp.gate_up_proj.bias),
            down=mlp.down_proj.weight.detach(),
            down_bias=_detached(mlp.down_proj.bias),
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            eps=self.input_layernorm.eps,
            scale=attn.scale,
            packed=[] if any(p is None for p in packed) else packed,
            packed_min_rows=Linear.packed_min_rows,
            few_rows_max=min(p.few_rows_max for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)),
        )

    def forward(self, x, cos, sin_signed, cache_layer, meta) -> torch.Tensor:
        decodes_only = x.shape[0] == meta.num_decodes and len(meta.decodes) == 1  # the runner's one group
        if self.fused is not None and meta.fused_decode and decodes_only:
            rows, slots = meta.decodes[0], meta.slot_mapping
            return self.fused(x, cos, sin_signed, cache_layer, slots, rows.block_table, rows.lengths, meta.hnd)
        if self.group is None and not self.sandwich:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin_signed, cache_layer, meta)
            return x + self.mlp(self.post_attention_layernorm(x))
        attn = self.self_attn(self.input_layernorm(x), cos, sin_signed, cache_layer, meta)
        if self.group is not None:
            self.group.all_reduce(attn)
        if self.sandwich:
            attn = self.post_attention_layernorm(attn)
        x = x + attn
        mlp = self.mlp(self.pre_feedforward_layernorm(x) if self.sandwich else self.post_attention_layernorm(x))
        if self.group is not None:
            self.group.all_reduce(mlp)
        if self.sandwich:
            mlp = self.post_feedforward_layernorm(mlp)
        return x + mlp


def layer_windows(cfg) -> list[int | None]:
    """Each layer's sliding window (None: full attention): ``layer_types`` where the config has them
    (Qwen2/Qwen3's sliding layers), else Mistral's and Mixtral's ``sliding_window`` on every layer."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return [int(window) if kind == "sliding_attention" and window else None for kind in types]
    if cfg.model_type in ("mistral", "mixtral") and window:
        return [int(window)] * cfg.num_hidden_layers
    return [None] * cfg.num_hidden_layers


class CausalLM(nn.Module):
    """Decoder-only LM over a flattened batch of tokens from many requests."""

    def __init__(
        self,
        cfg,
        head_dim: int,
        qk_norm: bool,
        attention_bias: bool,
        shard: Shard = Shard(),
        group: RankGroup | None = None,
    ) -> None:
        super().__init__()
        assert shard.whole or group is not None, "a shard needs its rank group"
        self.vocab_size = cfg.vocab_size
        self.group = group
        self.latent = latent_width(cfg) is not None  # multi-head latent attention (engine/mla.py)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        experts = MoESpec.of(cfg)
        windows = layer_windows(cfg)
        self.flavor = flavor = Flavor.of(cfg)
        _, ropes = rope_tables(cfg)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                head_dim,
                qk_norm,
                attention_bias,
                shard,
                group,
                experts if experts and i in experts.layers else None,
                windows[i],
                flavor,
                ropes[i],
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, flavor.norm_offset)
        self.lm_head = Linear(cfg.hidden_size, shard.vocab_rows(cfg.vocab_size), bias=False)

    def pack_for_cpu(self) -> None:
        """Lays every projection's weight out for the CPU (:class:`Linear`), and gives bfloat16 norms
        their CPU kernel (:class:`RMSNorm`). A float32 tied lm_head gets its own input-major copy;
        the embedding keeps the rows its lookups read, which a few rows' logits read too where
        engine.native's ``logits_f32`` serves them (:meth:`Linear.read_rows`)."""
        if self.group is None and self.lm_head.weight is self.embed_tokens.weight:
            self.lm_head.read_rows(self.embed_tokens.weight.detach())
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
            elif isinstance(module, RMSNorm):
                module.use_cpu_kernel()
        for layer in self.layers:  # over the weights as packed: bfloat16 keeps each [out, in] as it is
            layer.use_cpu_kernel()

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv: torch.Tensor | Sequence[torch.Tensor],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor | None:
        """Runs every layer; returns float32 logits for ``logits_rows`` only (on rank 0 of a
        sharded model; None on the other ranks). ``cos`` and ``sin_signed``: [tables, tokens, 1, head_dim],
        a table per RoPE the model uses (:func:`rope_tables`).

        ``on_layer(i)`` is called once layer i has run (its K/V are in the cache),
        so a prefill server can ship that layer while the next one computes.
        """
        x = self.embed_tokens(input_ids)
        if self.flavor.embed_scale is not None:
            x = x * torch.tensor(self.flavor.embed_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos[layer.rope_index], sin_signed[layer.rope_index], kv[i], meta)
            if on_layer is not None:
                on_layer(i)
        x = self.norm(x[logits_rows])
        logits = self.lm_head(x)
        if self.flavor.final_softcap is not None:
            logits = torch.tanh(logits / self.flavor.final_softcap) * self.flavor.final_softcap
        logits = logits.float()
        if self.group is None:
            return logits
        gathered = self.group.gather_logits(logits)
        return None if gathered is None else gathered[:, : self.vocab_size]
