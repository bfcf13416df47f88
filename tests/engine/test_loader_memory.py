"""The loader's memory peak: packing for the CPU replaces each projection's weight with its own layouts
(engine/model.py ``Linear.pack_for_cpu``), and the weight it replaces must be freed then, not when
``load_model`` returns. Held to the end, the old weights put a float32 Qwen2.5-Coder-0.5B server at 6.5 GB
while loading instead of the 4.6 GB it keeps, enough for the kernel to kill a server starting beside others."""

from __future__ import annotations

import gc
import weakref

import torch

from engine.loader import load_model
from engine.model import CausalLM, Linear


def test_each_weight_packing_replaces_is_freed_before_the_load_returns(tiny_model, monkeypatch):
    replaced_alive: list[int] = []
    replaced_total: list[int] = []
    pack = CausalLM.pack_for_cpu

    def pack_and_count(self: CausalLM) -> None:
        before = {name: weakref.ref(m.weight) for name, m in self.named_modules() if isinstance(m, Linear)}
        pack(self)
        gc.collect()
        modules = dict(self.named_modules())
        gone = [ref for name, ref in before.items() if ref() is not modules[name].weight]
        kept = {id(p) for p in self.parameters()}  # a tied lm_head's old weight is still the embedding's
        replaced_total.append(len(gone))
        replaced_alive.append(sum(ref() is not None and id(ref()) not in kept for ref in gone))

    monkeypatch.setattr(CausalLM, "pack_for_cpu", pack_and_count)
    model, _ = load_model(tiny_model, torch.float32, torch.device("cpu"))
    assert replaced_total[0] > 0  # float32 projections get an input-major copy in place of the loaded weight
    assert replaced_alive == [0]  # nothing in the loader still holds the weights packing replaced
    assert all(isinstance(m.weight, torch.nn.Parameter) for m in model.modules() if isinstance(m, Linear))
