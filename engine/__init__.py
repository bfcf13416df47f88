"""pdserve's inference engine: paged KV cache, continuous batching, Llama/Qwen3 models.

See ``engine.engine.LLMEngine`` for the API the servers use.

``EngineConfig`` and the request types import no torch; the engine itself
(``LLMEngine`` and its results) is imported on first use, so a process that
only reads settings (the launcher, the cluster config in deploy/config.py)
never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.request import NoCapacityError, SamplingParams, StepOutput

if TYPE_CHECKING:
    from engine.engine import EngineStats, GenerationResult, LLMEngine, PrefillChunk

_LOADED_ON_USE = ("EngineStats", "GenerationResult", "LLMEngine", "PrefillChunk")  # all in engine/engine.py

__all__ = [
    "EngineConfig",
    "EngineStats",
    "GenerationResult",
    "LLMEngine",
    "NoCapacityError",
    "PrefillChunk",
    "SamplingParams",
    "StepOutput",
]


def __getattr__(name: str):
    if name in _LOADED_ON_USE:
        return getattr(importlib.import_module("engine.engine"), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
