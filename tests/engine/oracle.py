"""Reference outputs from Hugging Face transformers, the correctness oracle."""

from __future__ import annotations

import copy
import functools
from collections import Counter

import numpy as np
import torch

from engine.request import SamplingParams, StructuredSpec


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_release() -> None:
    """Drops the transformers models kept for later calls: a real model's float32 weights (2.5 GB for
    Qwen2.5-Coder-0.5B) are freed before servers of the same model need the memory."""
    _hf_model.cache_clear()


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
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt) :].tolist()


def engine_prompt_logprobs(engine, prompt: list[int]) -> list[float]:
    """The engine's side of :func:`hf_logits`: each prompt token's log-probability after the first."""
    engine.add_request("scored", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    entries = []
    while engine.has_unfinished():
        entries += [e.logprob for out in engine.step() for e in (out.prompt_logprobs or [])[1:]]
    return entries


def hf_logits(path: str, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(tokens), vocab] of one full forward pass."""
    with torch.no_grad():
        return _hf_model(path)(torch.tensor([tokens])).logits[0].float()


def hf_masked_greedy(path: str, prompt: list[int], spec: StructuredSpec, max_tokens: int) -> list[int]:
    """Greedy tokens from transformers float32 logits, each step restricted to the tokens llguidance allows."""
    from transformers import AutoTokenizer

    from engine.structured import StructuredOutputs

    model = _hf_model(path)
    eos = model.generation_config.eos_token_id
    eos = tuple(eos if isinstance(eos, list) else [eos])
    grammar = StructuredOutputs(AutoTokenizer.from_pretrained(path), model.config.vocab_size, eos).grammar(spec)
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        bits = np.unpackbits(np.frombuffer(grammar.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: logits.shape[0]].astype(bool))
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert grammar.accept(token)
        ids.append(token)
        out.append(token)
        if token in eos:
            break
    return out


def processed(row: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams, eos: tuple[int, ...]):
    """The reference: bias, min_tokens, repetition (prompt + output), frequency/presence (output)."""
    row = row.clone()
    for t, b in p.logit_bias:
        row[t] += b
    if len(out) < p.min_tokens:
        for t in [*p.stop_token_ids, *(() if p.ignore_eos else eos)]:
            row[t] = float("-inf")
    for t in set(prompt + out):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t, c in Counter(out).items():
        row[t] -= p.frequency_penalty * c + p.presence_penalty
    return row


def hf_processed_greedy(path, prompt, p: SamplingParams, eos) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy, one full forward per token; also each step's processed log-probabilities."""
    out, logprobs = [], []
    while len(out) < p.max_tokens:
        row = processed(hf_logits(path, prompt + out)[-1], prompt, out, p, eos)
        logprobs.append(torch.log_softmax(row, -1))
        out.append(int(row.argmax()))
        if (out[-1] in eos and not p.ignore_eos) or out[-1] in p.stop_token_ids:
            break
    return out, logprobs
