"""Engine configuration: one frozen object per engine, validated on creation.

``EngineConfig``'s defaults and the ``Literal`` types below are the only place
these settings are written: the cluster config (deploy/config.py) and the
command lines take them from here. This module imports no torch, so reading
them costs a process nothing (``engine/__init__.py`` loads the engine itself
on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, get_args

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as checked_dataclass

from engine.request import TENANT_NAME

if TYPE_CHECKING:
    import torch

Dtype = Literal["float32", "bfloat16", "float16"]
EngineMode = Literal["colocated", "prefill", "decode"]  # a server's role is its engine's mode
KvLayout = Literal["NHD", "HND"]
# auto: Triton's kernels on CUDA (engine/triton_attention.py), torch's ops elsewhere (with engine.native's
# kernels on CPU where they are built); triton on CPU runs only under Triton's interpreter (tests)
AttentionBackend = Literal["auto", "torch", "triton"]
# model: the model's weights compute every step; mock: no weights, each step's tokens come from a hash and its
# time from a step-cost profile (engine/mock.py), for clusters at scale on few cores
EngineKind = Literal["model", "mock"]
# the families engine/make_model.py builds tiny ones of
TINY_ARCHS = ("deepseek_v3", "gemma3", "llama", "mistral", "mixtral", "qwen3", "qwen3_moe")
DTYPES: tuple[str, ...] = get_args(Dtype)
MODES: tuple[str, ...] = get_args(EngineMode)
KV_LAYOUTS: tuple[str, ...] = get_args(KvLayout)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)

# The bounds of the engine's knobs, written once: EngineConfig checks them when it is made, and the
# cluster config (deploy/config.py) types its engine keys with them, so a bad value in a file is named
# there before any process starts.
BlockSize = Annotated[int, Field(ge=1, le=256)]  # tokens per KV block
AtLeastOne = Annotated[int, Field(ge=1)]  # blocks, bytes, sequences, tokens, threads
ModelLen = Annotated[int, Field(ge=2)]  # a prompt token and one to generate, at least
TenantName = Annotated[str, Field(pattern=TENANT_NAME)]


@checked_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class KvTiersConfig:
    """Tiers below the KV cache (engine/tiers/): the blocks the prefix cache evicts are written there and
    read back when a later prompt's chain continues past the cache. At least one tier."""

    host_bytes: AtLeastOne | None = None  # a host-memory pool of this many bytes; None: none
    disk_path: str | None = None  # a folder of one file per block (under a subfolder per layout); None: none
    disk_bytes: AtLeastOne | None = None  # the disk tier's bytes, at most (required with disk_path)
    # redis://host:port/db of a store every server shares (engine/tiers/redis_store.py); None: none. Its byte
    # limit is the Redis server's own (maxmemory, allkeys-lru).
    redis_url: str | None = None
    redis_timeout_s: Annotated[float, Field(gt=0)] = 0.2  # a store call slower than this is a miss
    # Each tenant's share of the Redis store, in bytes of values (engine/tiers/redis_store.py): a tenant's write
    # past it evicts that tenant's own oldest blocks, never another's. None: no shares (Redis's own LRU only).
    redis_max_bytes_per_tenant: AtLeastOne | None = None
    # The tenants the shares keep apart (the router's, filled in by deploy/config.py): a block for any other
    # name is charged to the default tenant, so a caller cannot open accounts of its own. Empty: every name.
    redis_tenants: tuple[TenantName, ...] = ()
    queue_blocks: AtLeastOne = 256  # blocks waiting for a tier's writer, at most; past it a write is dropped

    def __post_init__(self) -> None:
        if self.host_bytes is None and self.disk_path is None and self.redis_url is None:
            raise ValueError("kv_tiers names no tier: set host_bytes, disk_path and disk_bytes, or redis_url")
        if (self.disk_path is None) != (self.disk_bytes is None):
            raise ValueError("kv_tiers: disk_path and disk_bytes go together")
        if self.redis_max_bytes_per_tenant is not None and self.redis_url is None:
            raise ValueError("kv_tiers: redis_max_bytes_per_tenant is a share of the Redis store: set redis_url")


@checked_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class EngineConfig:
    """What an engine needs to know; derived values are properties.

    ``num_blocks`` wins over ``kv_cache_bytes`` when both are given.
    ``cache_salt`` is what besides the tokens makes two engines' K/V differ.
    """

    model: str
    dtype: Dtype = "float32"
    device: str = "cpu"
    block_size: BlockSize = 16
    num_blocks: AtLeastOne | None = None
    kv_cache_bytes: AtLeastOne = 256 * 1024 * 1024
    max_num_seqs: AtLeastOne = 64
    max_num_batched_tokens: AtLeastOne = 2048
    chunked_prefill: bool = True
    max_model_len: ModelLen | None = None
    num_threads: AtLeastOne | None = None
    # Take torch threads off the team while the process waits for cores, and give them back when they
    # free (engine/contention.py); only with more than one thread on the CPU.
    adapt_threads: bool = True
    mode: EngineMode = "colocated"
    kv_layout: KvLayout = "NHD"
    prefix_caching: bool = True  # reuse the K/V of cached full blocks (engine/block_manager.py)
    # Ranks the model is split over (engine/tensor_parallel.py): rank 0 is this engine, the others its
    # child processes (engine/tp_leader.py). kv_cache_bytes and num_blocks are per rank.
    tensor_parallel_size: AtLeastOne = 1
    # A mixture-of-experts model's experts split whole over the tensor-parallel ranks (engine/moe.py): 1 (each
    # expert's features split instead) or tensor_parallel_size.
    expert_parallel_size: AtLeastOne = 1
    # Which kernels compute paged attention (engine/runner.py ``attention_kernels``).
    attention_backend: AttentionBackend = "auto"
    # Decode-only steps replayed as CUDA graphs, one per padded batch size (engine/decode_graphs.py): CUDA,
    # one rank, the Triton backend. Off until measured on a device.
    cuda_graphs: bool = False
    # Host-memory and disk tiers for evicted prefix blocks (engine/tiers/); None: off. One rank only.
    kv_tiers: KvTiersConfig | None = None
    # Blocks of a cache of their own for the sliding-window layers of a model that mixes them with full-attention
    # layers (Gemma 3; engine/window_pool.py): a sequence's window layers then hold only the blocks their window
    # reads, and num_blocks (or what kv_cache_bytes leaves) are the full-attention layers' blocks. None: one
    # block table for every layer. Colocated, one rank, no kv_tiers, no cuda_graphs. A decoding sequence holds
    # at most ceil((window - 1) / block_size) + 1 of them, and a step's prompt chunks about one more per
    # block_size tokens: about max_num_seqs x that + max_num_batched_tokens / block_size hold every window.
    window_kv_blocks: AtLeastOne | None = None
    # mock: a simulated engine (engine/mock.py) with the real scheduler and block manager, no weights loaded
    kind: EngineKind = "model"
    # A mock engine's step times: a `pdserve plan --save-profile` file (bench/plan/profile.py); None: the
    # built-in figures (engine/step_cost.py DEFAULT_STEP_COST).
    mock_profile: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "mock" and (self.tensor_parallel_size > 1 or self.kv_tiers is not None or self.cuda_graphs):
            raise ValueError("a mock engine runs one rank with no kv_tiers and no cuda_graphs")
        if self.mock_profile is not None and self.kind != "mock":
            raise ValueError("mock_profile is read by a mock engine only (kind: mock)")
        if self.kv_tiers is not None and self.tensor_parallel_size > 1:
            raise ValueError("kv_tiers hold one rank's blocks: they need tensor_parallel_size 1")
        if self.window_kv_blocks is not None and (
            self.mode != "colocated"
            or self.tensor_parallel_size > 1
            or self.kv_tiers is not None
            or self.cuda_graphs
            or self.kind == "mock"
        ):
            raise ValueError(
                "window_kv_blocks needs mode colocated, tensor_parallel_size 1, no kv_tiers, no cuda_graphs and "
                "kind model (a transfer, a rank, a tier and a graph address one block table for every layer)"
            )
        if self.expert_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(
                f"expert_parallel_size must be 1 or tensor_parallel_size ({self.tensor_parallel_size}), "
                f"got {self.expert_parallel_size}"
            )

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
