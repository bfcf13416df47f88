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

from engine.model import CausalLM, RankGroup
from engine.tensor_parallel import Shard, split_problem

# model_type -> (per-head q/k RMSNorm, q/k/v bias)
ARCHITECTURES = {"llama": (False, None), "qwen3": (True, None), "qwen2": (False, True), "mistral": (False, False)}

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
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


def check_split(cfg, size: int) -> None:
    """Raises ValueError, naming the sizes, when the model cannot be split over ``size`` ranks."""
    problem = split_problem(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, size)
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
        check_split(cfg, shard.size)
    # Built in place, uninitialized: a meta-device build's to_empty() goes through torch's
    # reference ops, whose import (sympy) costs about a second of every start.
    with torch.device(device), _no_random_init():
        model = CausalLM(cfg, head_dim_of(cfg), qk_norm, bias, shard, group)
    model = model.to(dtype)
    params = dict(model.named_parameters())
    parts: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for file in _weight_files(Path(model_dir)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key.removeprefix("model.")
                if "rotary_emb" in name:
                    continue
                target, part = _fused_target(name)
                if target not in params:
                    raise ValueError(f"unexpected weight {key!r} in {file}")
                tensor = f.get_tensor(key)
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
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{model_dir}: weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.eval()
    if torch.device(device).type == "cpu":
        model.pack_for_cpu()  # weights laid out for the CPU's matmul kernels (engine/model.py Linear)
    return model, cfg


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
