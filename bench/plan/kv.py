"""``pdserve plan kv``: the KV cache bytes a model keeps per token, and for a prompt of N tokens.

    pdserve plan kv --model DIR|config.json [--tokens 4096] [--dtype bfloat16]

Read from the model's ``config.json`` alone (no weights, nothing else), per attention kind:

- full attention, multi-head or grouped-query: K and V of every KV head, ``2 x kv_heads x head_dim``
  values a token a layer;
- multi-head latent attention (DeepSeek-V2/V3: ``kv_lora_rank``): one compressed latent and the decoupled
  RoPE key, ``kv_lora_rank + qk_rope_head_dim`` values a token a layer, shared by every head;
- sliding-window layers (Gemma 3's ``layer_types``, Mistral's ``sliding_window``): as full attention per
  token, but a prompt keeps at most ``sliding_window`` tokens of them.

The two examples of the background texts, from configs in tests/data/: LLaMA-3-70B keeps 320 KiB a token
(80 layers x 8 KV heads x 128 x 2 x 2 bytes), 1.34 GB for 4,096 tokens; DeepSeek-V3 69 KB (61 layers x
(512 + 64) x 2 bytes), 0.29 GB.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class LayerKV:
    """What one layer keeps per token, and for how many tokens at most (None: all of them)."""

    values_per_token: int
    window: int | None = None


@dataclass(frozen=True)
class ModelKV:
    model_type: str
    attention: str
    layers: tuple[LayerKV, ...]

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """Per token of context, every layer counted (a sliding-window layer too, within its window)."""
        return sum(layer.values_per_token for layer in self.layers) * dtype_bytes

    def bytes_for(self, tokens: int, dtype_bytes: int) -> int:
        """What a sequence of ``tokens`` keeps: a sliding-window layer at most its window's tokens."""
        kept = (min(tokens, layer.window) if layer.window else tokens for layer in self.layers)
        return sum(n * layer.values_per_token for n, layer in zip(kept, self.layers)) * dtype_bytes


def model_kv(cfg: dict) -> ModelKV:
    """The KV a model of this ``config.json`` keeps; raises ValueError naming a missing field."""
    cfg = {**cfg, **(cfg.get("text_config") or {})}  # a multimodal config's language model
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
    except KeyError as exc:
        raise ValueError(f"config.json has no {exc.args[0]!r}") from None
    model_type = str(cfg.get("model_type", "unknown"))
    if cfg.get("kv_lora_rank"):
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        return ModelKV(model_type, "latent (MLA)", tuple(LayerKV(latent) for _ in range(layers)))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    per_layer = 2 * kv_heads * head_dim
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if window and types:
        kinds = [LayerKV(per_layer, int(window) if kind == "sliding_attention" else None) for kind in types]
        sliding = sum(1 for kind in types if kind == "sliding_attention")
        name = f"{'grouped-query' if kv_heads < heads else 'multi-head'}, {sliding} of {layers} layers sliding"
        return ModelKV(model_type, name, tuple(kinds[:layers]))
    if window and cfg.get("use_sliding_window", True):
        name = f"{'grouped-query' if kv_heads < heads else 'multi-head'}, every layer sliding"
        return ModelKV(model_type, name, tuple(LayerKV(per_layer, int(window)) for _ in range(layers)))
    name = "grouped-query" if kv_heads < heads else "multi-head"
    return ModelKV(model_type, name, tuple(LayerKV(per_layer) for _ in range(layers)))


def read_config(where: str) -> dict:
    path = Path(where).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no model folder with a config.json, nor a config.json")
    return json.loads(path.read_text())


def report(kv: ModelKV, tokens: int, dtype: str) -> str:
    size = DTYPE_BYTES[dtype]
    per_token = kv.bytes_per_token(size)
    total = kv.bytes_for(tokens, size)
    rows = [
        ("model type", kv.model_type),
        ("attention", f"{kv.attention}, {len(kv.layers)} layers"),
        ("KV per token", f"{per_token:,} bytes ({per_token / 1024:.1f} KiB) in {dtype}"),
        (f"KV for {tokens:,} tokens", f"{total:,} bytes ({total / 1e9:.2f} GB)"),
    ]
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(f"{label:<{width}}{value}" for label, value in rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR|config.json", help="a model folder, or its config.json")
    p.add_argument("--tokens", type=int, default=4096, metavar="N", help="a sequence's length (default 4096)")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bfloat16", help="the KV cache's (default bfloat16)")


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise ValueError(f"--tokens must be at least 1, got {args.tokens}")
    print(report(model_kv(read_config(args.model)), args.tokens, args.dtype))
    return 0
