"""Load a local Hugging Face folder (config + safetensors) into ``engine.model``.

Nothing is downloaded: config and tokenizer are read with
``local_files_only=True``. q/k/v and gate/up weights are concatenated into
the fused projections on load; tied embeddings share one tensor. A rank of a
tensor-parallel engine loads only its ``Shard``'s slices
(engine/tensor_parallel.py): each tensor is read whole, sliced, and dropped.
On CPU the projections are then packed for oneDNN (``CausalLM.pack_for_cpu``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from engine.mla import latent_width
from engine.model import CausalLM, RankGroup
from engine.moe import GroupLimitedGate, MoESpec
from engine.tensor_parallel import Shard, split_problem

# model_type -> (per-head q/k RMSNorm, q/k/v bias)
ARCHITECTURES = {
    "llama": (False, None),
    "qwen3": (True, None),
    "qwen2": (False, True),
    "mistral": (False, False),
    "qwen3_moe": (True, None),  # mixture of experts (engine/moe.py)
    "mixtral": (False, False),
    "gemma3_text": (True, None),  # sliding-window and global layers, sandwich norms (engine/model.py Flavor)
    "deepseek_v3": (False, None),  # latent attention (engine/mla.py), shared and routed experts (engine/moe.py)
}

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
# One expert's weight as checkpoints name it: Qwen3-MoE's, Mixtral's (w1 gate, w3 up, w2 down).
_EXPERT_KEY = re.compile(
    r"^layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
    r"|block_sparse_moe\.experts\.(\d+)\.(w1|w3|w2))\.weight$"
)
_EXPERT_PART = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj", 0),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj", 1),
}


def load_config(model_dir: str):
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {model_dir!r} has no config.json")
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {cfg.model_type!r} in {model_dir}; supported: {sorted(ARCHITECTURES)}"
        )
    return cfg


def check_features(cfg) -> None:
    """Raises ValueError naming a feature of a supported architecture that the engine does not compute, so
    that a model is refused rather than served wrongly: Qwen3-MoE's sliding window (its config does not say
    which layers slide), Gemma 3's attention soft-capping, bidirectional attention, another activation."""
    if cfg.model_type == "qwen3_moe" and getattr(cfg, "use_sliding_window", False) and cfg.sliding_window:
        raise ValueError(
            f"sliding_window={cfg.sliding_window} with use_sliding_window in a qwen3_moe config is not supported"
        )
    if cfg.model_type == "gemma3_text":
        if cfg.attn_logit_softcapping is not None:
            raise ValueError(f"attn_logit_softcapping={cfg.attn_logit_softcapping} in a gemma3 config is not supported")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention in a gemma3 config is not supported")
        if cfg.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={cfg.hidden_activation!r} in a gemma3 config is not supported")
    if cfg.model_type == "deepseek_v3":
        _check_deepseek(cfg)


def _check_deepseek(cfg) -> None:
    """What DeepSeek-V3's layout may say that the engine would not compute as transformers does: another
    RoPE than default or YaRN, another activation, quantized weights, another router than sigmoid scores
    with group-limited top-k; and a latent whose halves would not be equal (engine/kv_cache.py)."""
    rope_type = (cfg.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} in a deepseek_v3 config is not supported")
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r} in a deepseek_v3 config is not supported")
    if getattr(cfg, "quantization_config", None):
        raise ValueError("quantization_config in a deepseek_v3 config is not supported (quantized weights)")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ValueError(
            f"num_key_value_heads={cfg.num_key_value_heads} in a deepseek_v3 config is not supported "
            f"(latent attention has one key and value per query head: {cfg.num_attention_heads})"
        )
    if (cfg.kv_lora_rank + cfg.qk_rope_head_dim) % 2 or cfg.qk_rope_head_dim % 2:
        raise ValueError(
            f"kv_lora_rank={cfg.kv_lora_rank} with qk_rope_head_dim={cfg.qk_rope_head_dim} in a deepseek_v3 "
            "config is not supported (both must be even)"
        )
    for name, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        value = getattr(cfg, name, supported)
        if value != supported:
            raise ValueError(f"{name}={value!r} in a deepseek_v3 config is not supported (only {supported!r})")
    if cfg.n_routed_experts and cfg.first_k_dense_replace < cfg.num_hidden_layers:
        groups = cfg.n_group or 0
        if groups < 1 or cfg.n_routed_experts % groups or cfg.n_routed_experts // groups < 2:
            raise ValueError(
                f"n_group={cfg.n_group} in a deepseek_v3 config is not supported "
                f"(it must divide n_routed_experts={cfg.n_routed_experts} into groups of two or more)"
            )
        if not 1 <= (cfg.topk_group or 0) <= groups:
            raise ValueError(f"topk_group={cfg.topk_group} in a deepseek_v3 config is not supported")


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {path} has no *.safetensors weights")
    return files


def check_split(cfg, size: int, expert_parallel: bool = False) -> None:
    """Raises ValueError, naming the sizes, when the model cannot be split over ``size`` ranks."""
    # a latent is one KV head, replicated on every rank (engine/kv_cache.py)
    kv_heads = 1 if latent_width(cfg) is not None else cfg.num_key_value_heads
    problem = split_problem(cfg.num_attention_heads, kv_heads, cfg.intermediate_size, size)
    experts = MoESpec.of(cfg)
    if problem is None and experts is not None:
        if experts.shared_intermediate % size:
            problem = (
                f"the shared experts' {experts.shared_intermediate} features cannot be split evenly over {size} ranks"
            )
        elif expert_parallel and experts.num_experts % size:
            problem = f"{experts.num_experts} experts cannot be split evenly over expert_parallel_size={size}"
        elif not expert_parallel and experts.intermediate % size:
            problem = (
                f"each expert's {experts.intermediate} features cannot be split evenly over tensor_parallel_size={size}"
            )
    elif problem is None and expert_parallel:
        problem = "expert_parallel_size > 1 needs a mixture-of-experts model"
    if problem is not None:
        raise ValueError(f"{problem} (tensor_parallel_size must divide the model's heads and MLP)")


def load_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, shard: Shard = Shard(), group: RankGroup | None = None
) -> tuple[CausalLM, object]:
    cfg = load_config(model_dir)
    qk_norm, bias = ARCHITECTURES[cfg.model_type]
    if bias is None:
        bias = bool(getattr(cfg, "attention_bias", False))
    if not shard.whole:
        check_split(cfg, shard.size, shard.expert_parallel)
    # Built in place, uninitialized: a meta-device build's to_empty() goes through torch's
    # reference ops, whose import (sympy) costs about a second of every start.
    with torch.device(device), _no_random_init():
        model = CausalLM(cfg, head_dim_of(cfg), qk_norm, bias, shard, group)
    model = model.to(dtype)
    for module in model.modules():
        if isinstance(module, GroupLimitedGate):
            module.float()  # DeepSeek-V3's router stays float32 in any model dtype, as transformers keeps it
    _load_weights(model, cfg, model_dir, shard)
    model.eval()
    if torch.device(device).type == "cpu":
        model.pack_for_cpu()  # weights laid out for the CPU's matmul kernels (engine/model.py Linear)
    return model, cfg


def _load_weights(model: CausalLM, cfg, model_dir: str, shard: Shard) -> None:
    """Copies the folder's weights (``shard``'s part of each) into ``model``'s parameters. Its references
    to those parameters, the fused parts and the files' tensors end when it returns: packing for the CPU
    replaces each projection's weight with its own layouts, and frees the old one as it goes only when
    nothing else holds it (float32 Qwen2.5-Coder-0.5B: 6.5 GB at the peak when they outlived the packing,
    4.6 GB, the packed model itself, without)."""
    params = dict(model.named_parameters())
    parts: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    experts = _ExpertLoader(cfg, shard, params)
    for file in _weight_files(Path(model_dir)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key.removeprefix("model.").replace(".block_sparse_moe.gate.", ".mlp.gate.")
                if "rotary_emb" in name or _beyond_layers(name, cfg) or experts.take(name, key, f):
                    continue
                # a parameter of that name is not fused (latent attention's q_proj)
                target, part = (name, None) if name in params else _fused_target(name)
                if target not in params:
                    raise ValueError(f"unexpected weight {key!r} in {file}")
                tensor = _rope_deinterleaved(name, f.get_tensor(key), cfg)
                if not shard.whole:
                    tensor = _slice(name, tensor, cfg, shard)
                if part is None:
                    _copy(params[target], tensor, key)
                    loaded.add(target)
                else:
                    parts.setdefault(target, {})[part] = tensor
    for target, pieces in parts.items():
        expected = 3 if "qkv" in target else 2
        if len(pieces) != expected:
            raise ValueError(f"{model_dir}: {target} has {len(pieces)} of {expected} parts")
        _copy(params[target], torch.cat([pieces[i] for i in range(expected)]), target)
        loaded.add(target)
    if "lm_head.weight" not in loaded and getattr(cfg, "tie_word_embeddings", False):
        if shard.whole:
            model.lm_head.weight = model.embed_tokens.weight
        else:
            _copy(model.lm_head.weight, _slice("lm_head.weight", model.embed_tokens.weight, cfg, shard), "lm_head")
        loaded.add("lm_head.weight")
    loaded |= experts.complete()
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{model_dir}: weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Build modules without drawing their random initial weights: every weight is loaded from
    the folder. Drawing them even on the meta device costs torch's first import of its compiler
    (about 2 s of every server start)."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method  # type: ignore[method-assign]


def _beyond_layers(name: str, cfg) -> bool:
    """A layer past the model's last: DeepSeek-V3's multi-token prediction module (``layers.61`` in its
    checkpoints), which transformers does not load either."""
    match = _LAYER_KEY.match(name)
    return cfg.model_type == "deepseek_v3" and match is not None and int(match.group(1)) >= cfg.num_hidden_layers


def _rope_deinterleaved(name: str, tensor: torch.Tensor, cfg) -> torch.Tensor:
    """With ``rope_interleave`` (DeepSeek's checkpoints), RoPE rotates pairs (x0, x1), (x2, x3), ... of the
    query's and the latent key's RoPE values, and transformers returns them as evens then odds. The rows
    that make those values are put in that order here (each head's of ``q_proj`` / ``q_b_proj``, those
    of ``kv_a_proj_with_mqa``), so that rotate-half's rotation (engine/model.py ``rotate``) computes
    transformers' result exactly; their dot products are unchanged, the pair's order being the same in
    query and key."""
    if cfg.model_type != "deepseek_v3" or not cfg.rope_interleave:
        return tensor
    match = _LAYER_KEY.match(name)
    rest = match.group(2) if match else ""
    rope = cfg.qk_rope_head_dim
    order = list(range(0, rope, 2)) + list(range(1, rope, 2))
    if rest in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
        qk = cfg.qk_nope_head_dim + rope
        heads = tensor.shape[0] // qk
        starts = [h * qk + cfg.qk_nope_head_dim for h in range(heads)]
    elif rest in ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias"):
        starts = [cfg.kv_lora_rank]
    else:
        return tensor
    index = torch.arange(tensor.shape[0])
    for start in starts:
        index[start : start + rope] = torch.tensor(order) + start
    return tensor.index_select(0, index).contiguous()


def _slice(name: str, tensor: torch.Tensor, cfg, shard: Shard) -> torch.Tensor:
    """The part of the whole model's tensor ``name`` (Hugging Face's name, no ``model.``) that ``shard`` holds."""
    head_dim = head_dim_of(cfg)
    match = _LAYER_KEY.match(name)
    rest = match.group(2) if match else name
    if name == "lm_head.weight":
        rows = shard.vocab(cfg.vocab_size)
        out = tensor.new_zeros((shard.vocab_rows(cfg.vocab_size), *tensor.shape[1:]))
        out[: len(rows)] = tensor[rows.start : rows.stop]
        return out
    if match is None:
        return tensor  # embeddings and the final norm are whole on every rank
    if latent_width(cfg) is not None:
        sliced = _slice_latent(rest, tensor, cfg, shard)
        if sliced is not None:
            return sliced
    if rest.startswith("self_attn.q_proj."):
        return _rows(tensor, [h for h in shard.q_heads(cfg.num_attention_heads)], head_dim)
    if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return _rows(tensor, list(shard.kv_heads(cfg.num_key_value_heads)), head_dim)
    if rest == "self_attn.o_proj.weight":
        return _rows(tensor.T, list(shard.q_heads(cfg.num_attention_heads)), head_dim).T.contiguous()
    if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        features = shard.intermediate(cfg.intermediate_size)
        return tensor[features.start : features.stop].contiguous()
    if rest == "mlp.down_proj.weight":
        features = shard.intermediate(cfg.intermediate_size)
        return tensor[:, features.start : features.stop].contiguous()
    if rest in ("mlp.down_proj.bias", "self_attn.o_proj.bias"):
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)  # added once, before the sum
    return tensor  # norms (q_norm, k_norm, layer norms) are whole


class _ExpertLoader:
    """Puts experts' weights into a rank's stacked ``mlp.experts.gate_up_proj`` / ``down_proj``
    (engine/moe.py): from one tensor per expert and projection (checkpoints' names), or from the stacked
    tensors themselves (transformers' in-memory names). Another rank's experts are never read."""

    def __init__(self, cfg, shard: Shard, params: dict[str, torch.Tensor]) -> None:
        self.spec = MoESpec.of(cfg)
        self.shard, self.params = shard, params
        self.pieces: dict[str, int] = {}

    def take(self, name: str, key: str, f) -> bool:
        """True when ``name`` is an expert weight (copied, or skipped as another rank's)."""
        if self.spec is None:
            return False
        experts = self.shard.experts(self.spec.num_experts)
        features = self.shard.expert_intermediate(self.spec.intermediate)
        match = _EXPERT_KEY.match(name)
        if match is not None:
            layer, expert, part = (
                match.group(1),
                int(match.group(2) or match.group(4)),
                _EXPERT_PART[match.group(3) or match.group(5)],
            )
            if expert not in experts:
                return True
            local = expert - experts.start
            tensor = f.get_tensor(key)
            if part == 2:
                target = f"layers.{layer}.mlp.experts.down_proj"
                self._copy(target, self.params[target][local], tensor[:, features.start : features.stop], key)
            else:
                target = f"layers.{layer}.mlp.experts.gate_up_proj"
                rows = self.params[target][local].chunk(2)[part]
                self._copy(target, rows, tensor[features.start : features.stop], key)
            return True
        if not (name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and name in self.params):
            return False
        down = name.endswith("down_proj")
        tensor = f.get_tensor(key)[experts.start : experts.stop]
        if down:
            tensor = tensor[:, :, features.start : features.stop]
        else:
            gate, up = tensor.chunk(2, dim=1)
            tensor = torch.cat([gate[:, features.start : features.stop], up[:, features.start : features.stop]], 1)
        self._copy(name, self.params[name], tensor, key, pieces=len(experts) * (1 if down else 2))
        return True

    def _copy(self, target: str, into: torch.Tensor, tensor: torch.Tensor, key: str, pieces: int = 1) -> None:
        _copy(into, tensor, key)
        self.pieces[target] = self.pieces.get(target, 0) + pieces

    def complete(self) -> set[str]:
        """The stacked parameters every piece of which was loaded."""
        if self.spec is None:
            return set()
        count = len(self.shard.experts(self.spec.num_experts))
        need = {"gate_up_proj": 2 * count, "down_proj": count}
        return {t for t, n in self.pieces.items() if n == need[t.rsplit(".", 1)[1]]}


def _slice_latent(rest: str, tensor: torch.Tensor, cfg, shard: Shard) -> torch.Tensor | None:
    """A rank's part of a DeepSeek-V3 layer's tensor ``rest``, or None where it is sliced as another model's:
    its query heads' rows of ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``, their columns of ``o_proj``, its
    features of the shared experts. The latent's projections and norms are whole (the latent is replicated)."""
    heads = list(shard.q_heads(cfg.num_attention_heads))
    if rest in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
        return _rows(tensor, heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    if rest == "self_attn.kv_b_proj.weight":
        return _rows(tensor, heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    if rest == "self_attn.o_proj.weight":
        return _rows(tensor.T, heads, cfg.v_head_dim).T.contiguous()
    if rest.startswith("self_attn.") and rest != "self_attn.o_proj.bias":
        return tensor
    features = shard.intermediate(cfg.moe_intermediate_size * cfg.n_shared_experts)
    if rest in ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"):
        return tensor[features.start : features.stop].contiguous()
    if rest == "mlp.shared_experts.down_proj.weight":
        return tensor[:, features.start : features.stop].contiguous()
    return None


def _rows(tensor: torch.Tensor, heads: list[int], head_dim: int) -> torch.Tensor:
    """The rows of ``heads`` (each ``head_dim`` rows) of a projection's weight or bias, in that order."""
    index = torch.tensor([h * head_dim + d for h in heads for d in range(head_dim)], dtype=torch.long)
    return tensor.index_select(0, index).contiguous()


def _fused_target(name: str) -> tuple[str, int | None]:
    match = _LAYER_KEY.match(name)
    if match is None:
        return name, None
    layer, rest = match.groups()
    for hf_prefix, (fused, part) in _FUSED.items():
        if rest.startswith(hf_prefix + "."):
            return f"layers.{layer}.{fused}.{rest[len(hf_prefix) + 1 :]}", part
    return name, None


def _copy(param: torch.Tensor, tensor: torch.Tensor, key: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {key!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
