"""``kv_cache_bytes: auto``: each server's KV cache sized from the memory of the host it runs on.

A fixed default is wrong on every host but one: 256 MiB filled to 78 % under
four 1024-token streams of SmolLM2 on a 24 GiB machine, and is more than a
4 GiB pod has left once the weights are loaded. vLLM's CPU build asks the
user for a number (``VLLM_CPU_KVCACHE_SPACE``) or takes a fixed fraction of
the whole machine. Here ``auto`` gives the KV caches of the servers one host
starts a share of what that host has available when they start:

    left     = available - for each rank (its weights as held + RANK_OVERHEAD_BYTES)
    per rank = kv_cache_memory_fraction * left / ranks

rounded down to a MiB and capped, per server, at what its ``max_num_seqs``
sequences of ``max_model_len`` tokens could ever hold (more would never be used).
"Available" is the kernel's ``MemAvailable``, and inside a memory cgroup (a
Kubernetes pod's limit) the room left under its limit if that is less. A
share that cannot hold one sequence of ``max_model_len`` tokens is refused
with the figures, not started to fail under load.

``pdserve launch`` reads the host once, before it starts any server, and
sizes every server it starts there together (each is then started with
``--kv-cache-bytes``), so servers started at the same moment do not each see
the memory the others are about to take. A server started alone (a pod,
``pdserve decode --config``) sizes itself, as the only one on its host.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

AUTO = "auto"
MIB = 1 << 20
GIB = 1 << 30
# A server or rank process's own memory besides its weights and KV cache: the interpreter, torch, the
# tokenizer, the HTTP stack and each step's activations (a mock server, which holds neither weights nor a
# cache, runs in about 250 MiB RSS; a step's activations come on top).
RANK_OVERHEAD_BYTES = 512 * MIB
CGROUP = Path("/sys/fs/cgroup")
SAFETENSORS_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


@dataclass(frozen=True)
class HostMemory:
    """The host's memory in bytes: ``total`` and what can be taken now (``available``)."""

    total: int
    available: int

    @classmethod
    def read(cls, proc: Path = Path("/proc/meminfo"), cgroup: Path = CGROUP) -> HostMemory:
        """``MemTotal`` and ``MemAvailable``, each lowered to a memory cgroup's limit and the room left under it
        (cgroup v2 ``memory.max`` less ``memory.current``) where the process runs in one."""
        fields = {}
        for line in proc.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024  # kB
        total, available = fields["MemTotal"], fields["MemAvailable"]
        limit = _read_int(cgroup / "memory.max")
        if limit is not None:
            used = _read_int(cgroup / "memory.current") or 0
            total, available = min(total, limit), min(available, max(limit - used, 0))
        return cls(total, available)


def _read_int(path: Path) -> int | None:
    """A cgroup file's number; None where it is absent or says ``max`` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class ServerMemory:
    """What one server asks of its host's memory."""

    name: str
    ranks: int  # processes: its tensor-parallel ranks
    weight_bytes_per_rank: int
    kv_bytes_per_token: int  # one rank's, every layer's K and V
    max_model_len: int
    max_num_seqs: int

    @property
    def kv_ceiling(self) -> int:
        """The most KV one rank could ever hold: every sequence at full length."""
        return self.max_num_seqs * self.max_model_len * self.kv_bytes_per_token

    @property
    def kv_floor(self) -> int:
        """The least worth starting with: one sequence at full length."""
        return self.max_model_len * self.kv_bytes_per_token


def server_memory(
    name: str,
    model_dir: Path,
    dtype: torch.dtype,
    tensor_parallel_size: int,
    expert_parallel: bool,
    max_model_len: int | None,
    max_num_seqs: int,
    device: str = "cpu",
    weights_loaded: bool = True,
) -> ServerMemory:
    """What server ``name`` of model ``model_dir`` on ``device`` asks of its host's memory (``weights_loaded``
    False: a mock engine's, which loads none). A rank holds about 1/``tensor_parallel_size`` of the weights,
    on a CPU as many times over as engine/model.py's ``cpu_weight_copies`` says for ``dtype`` (bfloat16 twice:
    oneDNN's packed copy beside the plain weight its few-row kernel reads; float32 twice as well, or once with
    ``PDSERVE_F32_WEIGHT_COPIES=1``, read from this process's environment, which the servers it sizes inherit),
    and a tied float32 lm_head's own input-major copy of the embedding (and no packed copy where engine.native's
    ``logits_f32`` reads the embedding's rows instead); on a GPU they are the device's, not
    the host's (Qwen2.5-Coder-0.5B in float32: 2.5 GB of weights, 4.5 GB held, 2.5 GB with one copy).
    Imports torch and the model's config: the router, which reads the cluster file too, never calls it."""
    import torch

    from engine import native
    from engine.kv_cache import cache_heads
    from engine.loader import head_dim_of, load_config
    from engine.model import cpu_weight_copies
    from engine.tensor_parallel import Shard

    cfg = load_config(str(model_dir))
    heads, width, _ = cache_heads(cfg, Shard(0, tensor_parallel_size, expert_parallel), head_dim_of(cfg))
    item = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * cfg.num_hidden_layers * heads * width * item
    on_cpu = device.split(":")[0] == "cpu"
    copies = cpu_weight_copies(dtype)
    weights = copies * model_weight_bytes(model_dir, item) if on_cpu and weights_loaded else 0
    if weights and dtype == torch.float32 and getattr(cfg, "tie_word_embeddings", False):
        head = cfg.vocab_size * cfg.hidden_size * item
        weights += head  # the lm_head's input-major copy (CausalLM.pack_for_cpu)
        if tensor_parallel_size == 1 and native.kernel("logits_f32") and not native.kernel("gemv_f32"):
            weights -= (copies - 1) * head  # and no packed one (engine/model.py Linear.read_rows)
    weights //= tensor_parallel_size
    limit = cfg.max_position_embeddings
    return ServerMemory(
        name, tensor_parallel_size, weights, per_token, min(max_model_len or limit, limit), max_num_seqs
    )


def model_weight_bytes(model_dir: Path, item_bytes: int) -> int:
    """The bytes of ``model_dir``'s weights once loaded at ``item_bytes`` per value (floating tensors; others
    as stored), read from the safetensors headers alone."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            stored = SAFETENSORS_ITEM_BYTES.get(entry["dtype"], 4)
            total += count * (item_bytes if entry["dtype"] in ("F64", "F32", "F16", "BF16") else stored)
    return total


class KvMemoryError(ValueError):
    """The host has too little memory for ``auto`` to give a server a useful cache."""


def auto_kv_cache_bytes(memory: HostMemory, servers: Sequence[ServerMemory], fraction: float) -> dict[str, int]:
    """Each server's ``kv_cache_bytes`` (per rank) when ``servers`` share one host with ``memory``."""
    ranks = sum(s.ranks for s in servers)
    needed = sum(s.ranks * (s.weight_bytes_per_rank + RANK_OVERHEAD_BYTES) for s in servers)
    left = memory.available - needed
    per_rank = int(fraction * left / ranks) if left > 0 else 0
    sizes = {}
    for s in servers:
        size = min(per_rank // MIB * MIB, s.kv_ceiling)
        if size < s.kv_floor:
            raise KvMemoryError(
                f"kv_cache_bytes: auto leaves {size / MIB:.0f} MiB of KV cache to server {s.name!r}, less than one "
                f"sequence of {s.max_model_len} tokens needs ({s.kv_floor / MIB:.0f} MiB): the host has "
                f"{memory.available / GIB:.1f} GiB available, {needed / GIB:.1f} GiB of it for {ranks} server "
                f"process(es)' weights and runtime, and kv_cache_memory_fraction is {fraction:g}. Set "
                "kv_cache_bytes, a smaller max_model_len, or free memory"
            )
        sizes[s.name] = size
    return sizes


def describe(memory: HostMemory, servers: Sequence[ServerMemory], sizes: dict[str, int], fraction: float) -> str:
    """One line saying what ``auto`` chose and from what."""
    each = ", ".join(f"{s.name} {sizes[s.name] / MIB:.0f} MiB" for s in servers)
    weights = sum(s.ranks * s.weight_bytes_per_rank for s in servers)
    return (
        f"KV cache (kv_cache_bytes: auto): {each} per rank, from {memory.available / GIB:.1f} GiB available "
        f"of {memory.total / GIB:.1f} GiB, less {weights / GIB:.2f} GiB of weights as held and "
        f"{RANK_OVERHEAD_BYTES // MIB} MiB per process, times {fraction:g}"
    )
