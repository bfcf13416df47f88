"""pdserve's inference engine: paged KV cache, continuous batching, Llama/Qwen3 models.

See ``engine.engine.LLMEngine`` for the API the servers use.
"""

from engine.config import EngineConfig
from engine.engine import EngineStats, GenerationResult, LLMEngine, PrefillChunk
from engine.request import NoCapacityError, SamplingParams, StepOutput

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
