"""Reference outputs from Hugging Face transformers, the correctness oracle."""

from __future__ import annotations

import copy
import functools

import torch


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy completion token ids from transformers ``generate`` (float32, CPU).

    ``ignore_eos`` generates exactly ``max_new_tokens`` without masking EOS,
    like the engine's ``ignore_eos``.
    """
    model = _hf_model(path)
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    if ignore_eos:
        config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt):].tolist()


def hf_logits(path: str, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(tokens), vocab] of one full forward pass."""
    with torch.no_grad():
        return _hf_model(path)(torch.tensor([tokens])).logits[0].float()
