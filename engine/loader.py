"""Load a local Hugging Face folder (config + safetensors) into ``engine.model``.

Nothing is downloaded: config and tokenizer are read with
``local_files_only=True``. q/k/v and gate/up weights are concatenated into
the fused projections on load; tied embeddings share one tensor.
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

from engine.model import CausalLM

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


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> tuple[CausalLM, object]:
    cfg = load_config(model_dir)
    qk_norm, bias = ARCHITECTURES[cfg.model_type]
    if bias is None:
        bias = bool(getattr(cfg, "attention_bias", False))
    # Built in place, uninitialized: a meta-device build's to_empty() goes through torch's
    # reference ops, whose import (sympy) costs about a second of every start.
    with torch.device(device), _no_random_init():
        model = CausalLM(cfg, head_dim_of(cfg), qk_norm, bias)
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
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{model_dir}: weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.eval()
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
