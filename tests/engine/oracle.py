"""Reference outputs from Hugging Face transformers, the correctness oracle."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy completion token ids from transformers ``generate`` (float32, CPU)."""
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
        )
    return out[0, len(prompt):].tolist()
