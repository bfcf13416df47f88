"""Engine configuration: one frozen object per engine, validated on creation.

``EngineConfig``'s defaults and the ``Literal`` types below are the only place
these settings are written: the cluster config (deploy/config.py) and the
command lines take them from here. This module imports no torch, so reading
them costs a process nothing (``engine/__init__.py`` loads the engine itself
on first use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

Dtype = Literal["float32", "bfloat16", "float16"]
EngineMode = Literal["colocated", "prefill", "decode"]  # a server's role is its engine's mode
KvLayout = Literal["NHD", "HND"]
DTYPES: tuple[str, ...] = get_args(Dtype)
MODES: tuple[str, ...] = get_args(EngineMode)
KV_LAYOUTS: tuple[str, ...] = get_args(KvLayout)


@dataclass(frozen=True)
class EngineConfig:
    """What an engine needs to know; derived values are properties.

    ``num_blocks`` wins over ``kv_cache_bytes`` when both are given.
    ``cache_salt`` is what besides the tokens makes two engines' K/V differ.
    """

    model: str
    dtype: Dtype = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None
    mode: EngineMode = "colocated"
    kv_layout: KvLayout = "NHD"
    prefix_caching: bool = True  # reuse the K/V of cached full blocks (engine/block_manager.py)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size {self.block_size} must be between 1 and 256")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks {self.num_blocks} must be at least 1")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes {self.kv_cache_bytes} must be positive")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs {self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len {self.max_model_len} must be at least 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads {self.num_threads} must be at least 1")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout {self.kv_layout!r} is not one of {list(KV_LAYOUTS)}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {list(MODES)}")

    @property
    def cache_salt(self) -> str:
        return f"{self.model}|{self.dtype}"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)
