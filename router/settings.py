"""The router's frozen settings (built from the cluster YAML by deploy.config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str  # "prefill" | "decode"
    url: str


@dataclass(frozen=True)
class RouterSettings:
    model_path: str  # local Hugging Face folder (tokenizer, config, chat template)
    served_model_name: str
    workers: tuple[WorkerSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"  # round_robin | least_loaded
    local_prefill_threshold: int = 0
    health_interval: float = 2.0
    queue_timeout: float = 10.0
    prefill_timeout: float = 120.0
    max_model_len: int | None = None  # None: the model config's max_position_embeddings
    api_keys: tuple[str, ...] = ()  # empty: no auth
