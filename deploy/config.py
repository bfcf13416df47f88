"""The cluster config: one YAML file describes an xPyD (or colocated) cluster.

Loaded strictly: an unknown key or a bad value stops the start with one line
naming the file, the key and the value. Each process derives its own frozen
settings from it (``router_settings``, ``server_settings``), so every port,
block size and thread count comes from this one file. Example (see configs/)::

    model: smollm2            # a local Hugging Face folder, or a built-in model (tiny, smollm2, ...)
    engine: {num_threads: 1}  # defaults for every instance
    router: {port: 8000, policy: round_robin, local_prefill_threshold: 0}
    transfer: {backend: zmq}
    lease_s: 30
    recovery: {prefill_failure: retry, lease_expiry: fail, checksum_failure: fail}
    prefill: [{name: p0, port: 8100, block_size: 16}]
    decode:  [{name: d0, port: 8200, block_size: 32}]

A colocated cluster lists ``colocated:`` instances instead of prefill/decode.
Every field carries its meaning as the docstring under it; docs/config.md,
the reference of every key with its type and default, is generated from
this schema by scripts/config_reference.py (a test fails when it is stale or
a field has no docstring). The ``kubernetes:`` section (read only by
`pdserve render k8s`) is in deploy/k8s_config.py, ``security:`` in
deploy/config_security.py; secrets are ``SecretStr`` so no repr, log line or
config error ever shows them.

The defaults and allowed values of the processes' settings are not written
here: each is taken from the settings object of the process that uses it
(``EngineConfig`` in engine/config.py, ``ServerSettings`` in
server_common/settings.py, ``RouterSettings`` in router/settings.py), so a
key left out means exactly what that process does without it. This module
adds only the bounds a value read from a file must keep, and the keys that
exist only in the cluster file (ports, instance lists, ``model_cache``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, model_validator

from deploy.config_security import ConfigError as ConfigError  # callers catch it as deploy.config's
from deploy.config_security import SecurityConfig, Strict, looks_secret
from deploy.k8s_config import KubernetesConfig
from deploy.kv_memory import AUTO, HostMemory, ServerMemory, auto_kv_cache_bytes, server_memory
from engine.config import (
    AtLeastOne,
    AttentionBackend,
    BlockSize,
    Dtype,
    EngineConfig,
    EngineKind,
    EngineMode,
    KvLayout,
    KvTiersConfig,
    ModelLen,
)
from engine.models import MODEL_CACHE, is_builtin, resolve_model
from engine.request import TENANT_NAME
from engine.structured import GRAMMAR_CEILING, GrammarLimits
from engine.tensor_parallel import split_problem
from router.settings import (
    DEFAULT_CLASSES,
    DEFAULT_TENANT,
    CompileSandbox,
    DiscoveryKind,
    DiscoverySettings,
    KvEventsMode,
    PolicyName,
    PrefillFailure,
    ResponseStoreSettings,
    RouterSettings,
    TenantSettings,
    WorkerSpec,
)
from server_common.process_defaults import DRAIN_TIMEOUT_S, LOOPBACK_HOST, DrainMode, is_loopback
from server_common.settings import KvFailureAction, ServerSettings, TransferBackendName
from server_common.tracing import TracingSettings
from wire.names import INSTANCE_NAME


class KvTiersSettings(Strict):
    """engine.kv_tiers (or an instance's): tiers below each server's KV cache (engine/tiers/, docs/kv-tiers.md).
    The blocks its prefix cache evicts are written there and loaded back, instead of computed, when a later
    prompt's prefix continues past the cache. Off while none of `host_bytes`, `disk_path` and `redis_url` is
    set; one rank only (tensor_parallel_size 1)."""

    host_bytes: AtLeastOne | None = None
    """Bytes of host memory holding evicted blocks (on a CPU server, a second pool beside the cache); null: no
    host tier."""
    disk_path: str | None = None
    """A folder of one checksummed file per block; each server writes under `<disk_path>/<its name>/`, so
    a server restarted on it serves what it wrote before. Null: no disk tier."""
    disk_bytes: AtLeastOne | None = None
    """Bytes of files the disk tier keeps, at most (oldest used go first); required with `disk_path`."""
    redis_url: SecretStr | None = None
    """A Redis server every server shares (redis://[:password@]host:port/db): the blocks any server evicts,
    read by every server with the same model, dtype, block size and order (engine/tiers/redis_store.py). Its
    byte limit is the Redis server's (`maxmemory`, with `maxmemory-policy allkeys-lru`). Null: none."""
    redis_timeout_s: float = Field(default=KvTiersConfig.redis_timeout_s, gt=0)
    """Seconds a call to the Redis store may take; a slower or failed one is a miss (or a dropped write), and
    the store is left alone for a while."""
    redis_max_bytes_per_tenant: AtLeastOne | None = None
    """Each tenant's share of the Redis store, in bytes (`router.tenants`; without API keys every request is
    the `default` tenant's): a block is charged to the tenant whose request computed it (a block two tenants
    share, to the first that wrote it), and a tenant's write past its share evicts that tenant's own least
    recently used blocks, never another's; counted on the Redis server itself (engine/tiers/redis_shares.py).
    A name that `router.tenants` does not list is charged to `default`. Run that Redis with
    `maxmemory-policy noeviction` and a `maxmemory` above the tenants' shares together. Null: no shares
    (Redis's own LRU over everything)."""
    queue_blocks: AtLeastOne = KvTiersConfig.queue_blocks
    """Blocks waiting for a tier's writer, at most; past it a write is dropped (counted), never waited for."""

    @property
    def on(self) -> bool:
        return self.host_bytes is not None or self.disk_path is not None or self.redis_url is not None

    @model_validator(mode="after")
    def _whole_disk(self) -> KvTiersSettings:
        if self.on:
            self._engine_config(self.disk_path)  # its checks, named here
        elif self.disk_bytes is not None:
            raise ValueError("kv_tiers: disk_path and disk_bytes go together")
        elif self.redis_max_bytes_per_tenant is not None:
            KvTiersConfig(host_bytes=1, redis_max_bytes_per_tenant=self.redis_max_bytes_per_tenant)  # its message
        return self

    def for_server(self, name: str, tenants: tuple[str, ...] = ()) -> KvTiersConfig | None:
        """Server ``name``'s tiers (its own folder under ``disk_path``); None when off. ``tenants``: the
        router's, the only names the store's shares keep apart."""
        if not self.on:
            return None
        return self._engine_config(None if self.disk_path is None else str(Path(self.disk_path) / name), tenants)

    def _engine_config(self, folder: str | None, tenants: tuple[str, ...] = ()) -> KvTiersConfig:
        url = None if self.redis_url is None else self.redis_url.get_secret_value()
        shares = tenants if self.redis_max_bytes_per_tenant is not None else ()
        return KvTiersConfig(**{**self.model_dump(), "disk_path": folder, "redis_url": url, "redis_tenants": shares})


class EngineDefaults(Strict):
    """Engine settings every instance inherits unless it overrides them (defaults and bounds: EngineConfig)."""

    block_size: BlockSize = EngineConfig.block_size
    """Tokens per KV block; prefill and decode servers may differ (the transfer converts)."""
    num_threads: AtLeastOne | None = EngineConfig.num_threads
    """Torch threads of each server process; null: torch's own default."""
    adapt_threads: bool = EngineConfig.adapt_threads
    """With more than one thread on the CPU: take one off while the server's threads wait for cores (a busy
    neighbour process) and give it back when they free (engine/contention.py)."""
    device: str | None = None
    """The torch device of each server (cpu, cuda, cuda:1, ...); null: the cluster's `device`."""
    kv_cache_bytes: AtLeastOne | Literal["auto"] = EngineConfig.kv_cache_bytes
    """Bytes of KV cache per server (`num_blocks` wins when both are set); auto: a share of the memory its host
    has available at the start, after every server's weights there (`kv_cache_memory_fraction`;
    deploy/kv_memory.py)."""
    kv_cache_memory_fraction: float = Field(default=0.5, gt=0, le=0.9)
    """With `kv_cache_bytes: auto`: the share of a host's available memory, after the weights and runtime of
    the servers it starts, that their KV caches take together (split evenly over their ranks)."""
    num_blocks: AtLeastOne | None = EngineConfig.num_blocks
    """KV blocks per server; null: as many as `kv_cache_bytes` holds."""
    max_num_seqs: AtLeastOne = EngineConfig.max_num_seqs
    """Sequences an engine runs at once, at most; also each worker's default in-flight limit at the router."""
    max_num_batched_tokens: AtLeastOne = EngineConfig.max_num_batched_tokens
    """The token budget of one engine step: prompt tokens and decoded tokens together, at most."""
    chunked_prefill: bool = EngineConfig.chunked_prefill
    """Split a prompt longer than a step's budget over several steps; false: it runs alone in one step."""
    kv_layout: KvLayout = EngineConfig.kv_layout
    """The order inside a KV block: NHD (slot, head, dim) or HND (head, slot, dim)."""
    prefix_caching: bool = EngineConfig.prefix_caching
    """Reuse the KV of the full blocks a prompt shares with an earlier one."""
    tensor_parallel_size: AtLeastOne = EngineConfig.tensor_parallel_size
    """Ranks each server splits the model over (one process each, one device each on CUDA; rank 0 is the
    server); it must divide the model's attention heads and MLP. `kv_cache_bytes` and `num_blocks` are per
    rank. Prefill, decode and colocated servers alike."""
    expert_parallel_size: AtLeastOne = EngineConfig.expert_parallel_size
    """A mixture-of-experts model's experts split whole over the tensor-parallel ranks (each holds 1/N of
    them): 1 (every rank holds every expert, its features split) or `tensor_parallel_size`."""
    attention_backend: AttentionBackend = EngineConfig.attention_backend
    """The kernels of paged attention: auto (Triton's on CUDA, engine/triton_attention.py; on CPU
    engine.native's where built, else torch's), torch (torch's ops alone, the fallback), or triton (CUDA
    only)."""
    cuda_graphs: bool = EngineConfig.cuda_graphs
    """Replay decode-only steps as CUDA graphs, one per padded batch size (engine/decode_graphs.py); needs
    CUDA, tensor_parallel_size 1 and the Triton backend. Off by default: not yet measured on a device."""
    kv_tiers: KvTiersSettings = KvTiersSettings()
    """Host-memory and disk tiers for the blocks each server's prefix cache evicts (off unless a tier is set)."""
    window_kv_blocks: AtLeastOne | None = EngineConfig.window_kv_blocks
    """For a model mixing sliding-window and full-attention layers (Gemma 3): KV blocks of a cache of their own
    for the window layers (engine/window_pool.py), so that each sequence's window layers hold only the blocks
    their window reads; `num_blocks` (or what `kv_cache_bytes` leaves) are then the full-attention layers'.
    About `max_num_seqs` x (ceil((window - 1) / block_size) + 1) + `max_num_batched_tokens` / block_size hold
    every window. null: one block table for every layer. Colocated clusters only, one rank, no `kv_tiers`,
    no `cuda_graphs`, kind model."""
    kind: EngineKind = EngineConfig.kind
    """model (the model computes each step) or mock: a simulated engine (engine/mock.py) with the real scheduler,
    block manager and KV protocol but no weights loaded, hashed tokens and each step's time slept from
    `mock_profile`; light enough for dozens of servers on a few cores. Prefill and decode servers of one cluster
    are all mock or all model (their KV layouts differ)."""
    mock_profile: str | None = EngineConfig.mock_profile
    """A mock engine's step costs: a `pdserve plan --save-profile` file; null: engine/mock.py's built-in
    figures."""


class Instance(Strict):
    """One server of the cluster: its name, addresses and ports, and the engine keys it overrides (null: the
    ``engine:`` section's value)."""

    name: str = Field(pattern=INSTANCE_NAME)
    """Its name, unique in the cluster: `pdserve prefill|decode --name`, its log, its transfer identity."""
    port: int = Field(ge=1, le=65535)
    """Its HTTP port."""
    kv_port: int | None = Field(default=None, ge=1, le=65535)
    """Its transfer port (where a decode server's ZeroMQ receiver listens); null: `port` + 1."""
    host: str | None = None
    """The address others reach it at (advertised in reservations and handshakes); null: the cluster's `host`."""
    bind_host: str | None = None
    """The address it binds (0.0.0.0: every interface); null: its `host`."""
    max_inflight: int | None = Field(default=None, ge=1)
    """Requests the router sends it at once, at most; null: `router.max_inflight_per_worker`, else its
    `max_num_seqs`."""
    block_size: BlockSize | None = None
    """Its tokens per KV block."""
    num_threads: AtLeastOne | None = None
    """Its torch threads."""
    device: str | None = None
    """Its torch device."""
    kv_cache_bytes: AtLeastOne | Literal["auto"] | None = None
    """Its bytes of KV cache (auto: sized from its host's memory)."""
    num_blocks: AtLeastOne | None = None
    """Its KV blocks."""
    max_num_seqs: AtLeastOne | None = None
    """Its sequences at once, at most."""
    max_num_batched_tokens: AtLeastOne | None = None
    """Its token budget per engine step."""
    kv_layout: KvLayout | None = None
    """Its order inside a KV block."""
    tensor_parallel_size: AtLeastOne | None = None
    """Ranks it splits the model over."""
    expert_parallel_size: AtLeastOne | None = None
    """Ranks it splits a mixture of experts' experts over."""
    kv_tiers: KvTiersSettings | None = None
    """Its KV tiers (the whole section: replaces the `engine:` one; `{}` turns them off)."""
    kind: EngineKind | None = None
    """model or mock (engine/mock.py)."""
    mock_profile: str | None = None
    """Its mock engine's step-cost profile."""

    @property
    def transfer_port(self) -> int:
        return self.kv_port if self.kv_port is not None else self.port + 1


# The engine keys one instance may override (None: the engine: section's value): Instance's fields that
# are EngineDefaults' too.
INSTANCE_ENGINE_KEYS = tuple(key for key in Instance.model_fields if key in EngineDefaults.model_fields)


class GrammarLimitsConfig(Strict):
    """How large a grammar, JSON schema, regex or choice list (``guided_*``,
    ``structured_outputs``, ``response_format``, forced tool calls) a request may send; larger ones get
    400 before anything is compiled. Each is capped by what the compiler survives (GRAMMAR_CEILING)."""

    max_bytes: int = Field(default=GrammarLimits.max_bytes, ge=1, le=GRAMMAR_CEILING.max_bytes)
    """Bytes of its text (a grammar, the schema as JSON, the regex, the choices as JSON)."""
    max_rules: int = Field(default=GrammarLimits.max_rules, ge=1, le=GRAMMAR_CEILING.max_rules)
    """Rule and terminal definitions in a Lark grammar."""
    max_depth: int = Field(default=GrammarLimits.max_depth, ge=1, le=GRAMMAR_CEILING.max_depth)
    """Levels of nesting: of a schema's objects and lists, of a grammar's or regex's groups."""
    max_branches: int = Field(default=GrammarLimits.max_branches, ge=1, le=GRAMMAR_CEILING.max_branches)
    """Alternatives: `anyOf`/`oneOf`/`allOf` and `enum` items, choices, `|` in a grammar or regex."""
    compile_timeout_s: float = Field(default=CompileSandbox.timeout_s, gt=0)
    """Seconds one compile in the router's grammar process may take; past it the request gets 400."""
    compile_memory_bytes: int = Field(default=CompileSandbox.memory_bytes, ge=64 << 20)
    """Bytes of address space the router's grammar process may use."""

    def limits(self) -> GrammarLimits:
        return GrammarLimits(
            max_bytes=self.max_bytes, max_rules=self.max_rules, max_depth=self.max_depth, max_branches=self.max_branches
        )

    def sandbox(self) -> CompileSandbox:
        return CompileSandbox(timeout_s=self.compile_timeout_s, memory_bytes=self.compile_memory_bytes)


class ResponseStoreConfig(Strict):
    """router.response_store: where stored ``/v1/responses`` live (router/api/response_store/): a SQLite
    file (the default), or a PostgreSQL database (``url``) that several routers share."""

    path: str | None = None
    """The SQLite file; null: `pdserve launch`'s run folder (responses.sqlite), or memory for a router
    started alone; several routers may share one file on a shared disk."""
    url: SecretStr | None = None
    """A PostgreSQL database instead of `path`, postgresql://user:password@host:5432/db (the database must
    exist; the table is made): routers that name the same one share their stored responses. Needs the
    postgres extra (psycopg)."""
    ttl_s: float = Field(default=ResponseStoreSettings.ttl_s, gt=0)
    """Seconds a stored response is kept."""
    max_rows: int = Field(default=ResponseStoreSettings.max_rows, ge=1)
    """Stored responses kept at most; beyond it the oldest go."""
    max_events: int = Field(default=ResponseStoreSettings.max_events, ge=16)
    """Events a background response keeps at most (about one per generated token); one that would need more
    stops there, its work on the servers freed, and ends failed."""
    max_event_bytes: int = Field(default=ResponseStoreSettings.max_event_bytes, ge=4096)
    """Bytes of events a background response keeps at most; past them it stops as past max_events."""

    @model_validator(mode="after")
    def _one_backend(self) -> ResponseStoreConfig:
        if self.path is not None and self.url is not None:
            raise ValueError("set router.response_store.path or router.response_store.url, not both")
        if self.url is not None and not self.url.get_secret_value().startswith(("postgresql://", "postgres://")):
            raise ValueError("router.response_store.url must be a postgresql:// URL")
        return self

    def settings(self, default_path: str | None) -> ResponseStoreSettings:
        url = None if self.url is None else self.url.get_secret_value()
        path = self.path or default_path or ResponseStoreSettings.path
        return ResponseStoreSettings(
            path=ResponseStoreSettings.path if url is not None else path,
            url=url,
            ttl_s=self.ttl_s,
            max_rows=self.max_rows,
            max_events=self.max_events,
            max_event_bytes=self.max_event_bytes,
        )


class TenantConfig(Strict):
    """One tenant: the API keys that are its own, its priority class, its share when the cluster is saturated,
    and its rate limits (router/cluster/tenancy.py)."""

    name: str = Field(pattern=TENANT_NAME)
    """The tenant's name in metrics and logs (lowercase letters, digits and '-'). `default` is every key listed
    only under `router.api_keys`; it may be configured here too, without keys of its own."""
    keys: list[SecretStr] = Field(default_factory=list)
    """Bearer keys that are this tenant's (they are accepted API keys)."""
    keys_file: str | None = None
    """A file with one of its keys per line, instead of `keys` (on Kubernetes, a mounted Secret)."""
    weight: float = Field(default=1.0, gt=0, le=1000)
    """Its share of the admitted work (prompt and output tokens) against the other tenants of its class, when
    requests wait."""
    priority: str | None = None
    """Its priority class, one of `router.priority_classes`; null: the middle one."""
    requests_per_minute: int | None = Field(default=None, ge=1)
    """Requests it may send per minute (429 with Retry-After past it); null: no limit."""
    tokens_per_minute: int | None = Field(default=None, ge=1)
    """Tokens it may ask for per minute: prompts, and `max_tokens` for each choice; null: no limit."""

    @model_validator(mode="after")
    def _one_key_source(self) -> TenantConfig:
        if self.keys and self.keys_file is not None:
            raise ValueError(f"tenant {self.name!r}: set keys or keys_file, not both")
        return self

    def key_values(self) -> tuple[str, ...]:
        if self.keys_file is None:
            return tuple(k.get_secret_value() for k in self.keys)
        return _read_keys(self.keys_file, f"router.tenants {self.name!r} keys_file")

    def settings(self) -> TenantSettings:
        return TenantSettings(
            self.name,
            self.key_values(),
            self.weight,
            self.priority,
            self.requests_per_minute,
            self.tokens_per_minute,
        )


def _read_keys(file: str, what: str) -> tuple[str, ...]:
    path = Path(file).expanduser()
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r}: cannot read it: {exc.strerror}") from None
    return tuple(line.strip() for line in lines if line.strip())


class RouterConfig(Strict):
    """The router. Overload: each worker takes at most ``max_inflight_per_worker``
    requests at once (default: its engine's ``max_num_seqs``; an instance's
    ``max_inflight`` overrides); beyond that requests wait, at most
    ``max_queued_requests`` of them for at most ``queue_timeout_s``, and the
    rest get 429 with ``Retry-After: retry_after_s``. Limits: bodies over
    ``max_body_bytes`` get 413, prompts over ``max_prompt_tokens`` and
    ``max_tokens`` over its cap get 400, and so does a request that may need more
    than ``max_request_kv_share`` of a decode server's KV cache (its prompt and
    ``n`` sequences of ``max_tokens``; one that did not set ``max_tokens`` gets
    a lower one instead). ``api_keys``: Bearer keys clients
    must send (none: no auth)."""

    port: int = Field(default=RouterSettings.port, ge=1, le=65535)
    """The router's HTTP port: the OpenAI API, /health, /metrics, /admin. With `replicas` > 1 the front (HAProxy,
    or on Kubernetes the router Service) listens here and the replicas on `replica_ports`."""
    replicas: int = Field(default=1, ge=1, le=64)
    """Routers serving the cluster, each a full router. Above 1, `pdserve launch` starts them behind HAProxy
    (Debian package `haproxy`) on `port`, and `pdserve render k8s` gives the router Deployment this many;
    each takes its part of every worker's in-flight limit and of every tenant's rate limits, so that together
    they never allow more than one router would."""
    replica_ports: list[int] | None = None
    """The replicas' own HTTP ports under `pdserve launch` when `replicas` > 1, one each; null: `port` + 1 to
    `port` + `replicas`."""
    host: str | None = None
    """The address clients reach the router at; null: the cluster's `host`."""
    bind_host: str | None = None
    """The address the router binds (e.g. 0.0.0.0 to serve other machines); null: its `host`."""
    policy: PolicyName = RouterSettings.policy
    """How a request's servers are picked: in turn, the least loaded, or the one caching most of its prompt."""
    local_prefill_threshold: int = Field(default=RouterSettings.local_prefill_threshold, ge=0)
    """A prompt whose part the decode server does not cache is shorter than this many tokens is prefilled on
    that decode server; 0: none is."""
    cache_aware_load_weight: float = Field(default=RouterSettings.cache_aware_load_weight, ge=0)
    """`cache_aware` policy: how much a server's load counts against the share of the prompt it caches."""
    kv_events: KvEventsMode = RouterSettings.kv_events
    """How the servers' block-hash events (for `cache_aware` and local prefill) reach the router: push (one
    stream per server, events as they happen) or poll (every `kv_events_interval_s`)."""
    kv_events_interval_s: float = Field(default=RouterSettings.kv_events_interval_s, gt=0)
    """With `kv_events: poll`, seconds between polls of the servers' block-hash events."""
    health_interval_s: float = Field(default=RouterSettings.health_interval_s, gt=0)
    """Seconds between health checks of a worker that answers."""
    health_timeout_s: float = Field(default=RouterSettings.health_timeout_s, gt=0)
    """Seconds a health check waits for its answer."""
    stream_stall_s: float = Field(default=RouterSettings.stream_stall_s, ge=3)
    """Seconds a decode stream may stay silent (servers send a heartbeat every second) before it fails and its
    server leaves rotation."""
    health_backoff_max_s: float = Field(default=RouterSettings.health_backoff_max_s, gt=0)
    """A worker that is down is checked at doubling intervals, up to this many seconds."""
    queue_timeout_s: float = Field(default=RouterSettings.queue_timeout_s, ge=0)
    """Seconds a request waits for a free slot before it gets 429."""
    max_queued_requests: int = Field(default=RouterSettings.max_queued_requests, ge=0)
    """Requests waiting for a slot, at most; one more gets 429 at once."""
    retry_after_s: float = Field(default=RouterSettings.retry_after_s, gt=0)
    """Seconds in the `Retry-After` header of a 429."""
    max_inflight_per_worker: int | None = Field(default=None, ge=1)
    """Requests the router sends one worker at once, at most; null: that instance's `max_num_seqs`."""
    prefill_timeout_s: float = Field(default=RouterSettings.prefill_timeout_s, gt=0)
    """Seconds the router waits for a prefill server's answer."""
    worker_connections: int = Field(default=RouterSettings.worker_connections, ge=1)
    """Open HTTP connections to all workers together, at most."""
    worker_keepalive: int = Field(default=RouterSettings.worker_keepalive, ge=0)
    """Idle connections to workers kept open for reuse."""
    worker_keepalive_s: float = Field(default=RouterSettings.worker_keepalive_s, gt=0)
    """Seconds an idle connection to a worker stays open (below the servers' own 5 s)."""
    max_body_bytes: int = Field(default=RouterSettings.max_body_bytes, ge=1024)
    """Request bodies over this many bytes get 413 before they are read."""
    max_prompt_tokens: int | None = Field(default=RouterSettings.max_prompt_tokens, ge=1)
    """Longer prompts get 400; null: only the context length limits them."""
    max_tokens: int | None = Field(default=RouterSettings.max_tokens, ge=1)
    """A larger `max_tokens` gets 400, and a request without one gets at most this; null: only the context."""
    max_request_kv_share: float = Field(default=RouterSettings.max_request_kv_share, gt=0, le=1)
    """The share of a decode server's KV cache one request may need (its prompt and `n` sequences of
    `max_tokens`); more is a 400, or a lower `max_tokens` for a request that set none."""
    api_keys: list[SecretStr] = Field(default_factory=list)
    """Bearer keys clients must send to the OpenAI routes (401 otherwise); empty: no auth."""
    header_timeout_s: float = Field(default=RouterSettings.header_timeout_s, gt=0)
    """Seconds a client has to send a request's headers before its connection is closed."""
    body_timeout_s: float = Field(default=RouterSettings.body_timeout_s, gt=0)
    """Seconds a client has to send a request's body after its headers."""
    max_connections_per_client: int = Field(default=RouterSettings.max_connections_per_client, ge=1)
    """Open connections from one address, at most; one more gets 503 `too_many_connections`."""
    client_keepalive_s: float = Field(default=RouterSettings.client_keepalive_s, gt=0)
    """Seconds an idle kept-alive client connection stays open (longer than clients keep theirs)."""
    access_log: bool = RouterSettings.access_log
    """One line per request in the router's log."""
    max_connections: int = Field(default=RouterSettings.max_connections, ge=2)
    """Open client connections in all (also kept 256 under the file-descriptor limit)."""
    reserved_connections: int = Field(default=RouterSettings.reserved_connections, ge=0)
    """Of `max_connections`, the last ones only for loopback callers (health checks on the host)."""
    api_keys_file: str | None = None
    """A file with one API key per line, instead of `api_keys` (on Kubernetes, a mounted Secret)."""
    grammar_limits: GrammarLimitsConfig = GrammarLimitsConfig()
    """How large a grammar a request may send, and the process the router compiles it in."""
    response_store: ResponseStoreConfig = ResponseStoreConfig()
    """Where /v1/responses keeps stored responses."""
    tenants: list[TenantConfig] = Field(default_factory=list)
    """Who the API keys are: each tenant's keys, priority class, weight and rate limits. Under saturation waiting
    requests are admitted by class, then by weighted fair queuing between tenants, not in arrival order."""
    priority_classes: list[str] = Field(default_factory=lambda: list(DEFAULT_CLASSES), min_length=1, max_length=16)
    """The priority classes, highest first; a request may ask for a lower class than its tenant's with the
    `X-Priority-Class` header."""
    tenant_share_window_s: float = Field(default=RouterSettings.tenant_share_window_s, ge=0)
    """While more than one tenant has asked for a slot within this many seconds, a tenant holding its weighted
    share of a decode server's slots leaves one free there for each tenant that used that server less (its slots
    averaged over the same span), so a light tenant finds a slot on arrival; costs a heavy tenant up to one slot
    per server and light tenant (router/cluster/fair_share.py). 0: no shares, fair queuing's order alone."""

    @model_validator(mode="after")
    def _one_key_source(self) -> RouterConfig:
        if self.api_keys and self.api_keys_file is not None:
            raise ValueError("set router.api_keys or router.api_keys_file, not both")
        if self.reserved_connections >= self.max_connections:
            raise ValueError("router.reserved_connections must be below router.max_connections")
        if self.replica_ports is not None and len(self.replica_ports) != self.replicas:
            raise ValueError(
                f"router.replica_ports lists {len(self.replica_ports)} ports for {self.replicas} replicas: one each"
            )
        if self.replica_ports is not None and any(not 1 <= p <= 65535 for p in self.replica_ports):
            raise ValueError(f"router.replica_ports must be ports (1-65535), got {self.replica_ports}")
        self._check_tenants()
        return self

    def _check_tenants(self) -> None:
        names = [t.name for t in self.tenants]
        if len(set(names)) < len(names):
            twice = sorted(n for n in set(names) if names.count(n) > 1)
            raise ValueError(f"router.tenants: a name is used twice: {twice}")
        if len(set(self.priority_classes)) < len(self.priority_classes):
            raise ValueError("router.priority_classes: a class is listed twice")
        for t in self.tenants:
            if t.priority is not None and t.priority not in self.priority_classes:
                raise ValueError(
                    f"router.tenants {t.name!r}: priority {t.priority!r} is not one of router.priority_classes "
                    f"({', '.join(self.priority_classes)})"
                )
            if t.name == DEFAULT_TENANT and (t.keys or t.keys_file is not None):
                raise ValueError("router.tenants 'default': its keys are those listed only under router.api_keys")

    def api_key_values(self) -> tuple[str, ...]:
        """Every accepted key: router.api_keys's and each tenant's."""
        plain = (
            tuple(k.get_secret_value() for k in self.api_keys)
            if self.api_keys_file is None
            else _read_keys(self.api_keys_file, "router.api_keys_file")
        )
        return plain + tuple(k for t in self.tenants for k in t.key_values())

    def tenant_settings(self) -> tuple[TenantSettings, ...]:
        """The tenants, their keys read; a key given to two tenants is an error."""
        tenants = tuple(t.settings() for t in self.tenants)
        owners: dict[str, str] = {}
        for t in tenants:
            for key in t.keys:
                if owners.setdefault(key, t.name) != t.name:
                    raise ConfigError(f"router.tenants: one key is listed for {owners[key]!r} and for {t.name!r}")
        return tenants


# The router: keys whose value RouterSettings takes as is, under the same name (the rest are derived).
ROUTER_KEYS_AS_IS = tuple(
    sorted(
        set(RouterConfig.model_fields)
        & {f.name for f in dataclasses.fields(RouterSettings)}
        - {"host", "port", "api_keys", "grammar_limits", "response_store", "tenants", "priority_classes"}
    )
)


class DiscoveryConfig(Strict):
    """How the router finds its workers. ``static``: the instances listed in
    this file. ``dns``: every ``interval_s`` the router re-resolves each of
    ``names``; each address is a worker, asked for its role, model and layout
    (a Kubernetes headless Service resolves to one address per ready pod, and
    its SRV record ``_http._tcp.NAME`` to each pod's HTTP port: see
    deploy/k8s.py)."""

    kind: DiscoveryKind = DiscoverySettings.kind
    """static: the instances this file lists; dns: the addresses `names` resolve to."""
    names: list[str] = Field(default_factory=list)
    """The DNS names to re-resolve, `HOST:PORT` each (the servers' HTTP port); kind dns only."""
    interval_s: float = Field(default=DiscoverySettings.interval_s, gt=0)
    """Seconds between two resolutions of `names`."""

    @model_validator(mode="after")
    def _names_for_dns(self) -> DiscoveryConfig:
        bad = [n for n in self.names if not re.fullmatch(r"[A-Za-z0-9_.-]+:\d{1,5}", n)]
        if bad:
            raise ValueError(f"discovery.names are HOST:PORT (the port the servers' HTTP listens on), got {bad}")
        if self.kind == "dns" and not self.names:
            raise ValueError("discovery.kind dns needs discovery.names (the DNS names to re-resolve)")
        if self.kind == "static" and self.names:
            raise ValueError("discovery.names is for kind dns; kind static uses the instances listed")
        return self


class RecoveryConfig(Strict):
    """What happens when a step of a request fails.

    ``prefill_failure`` (router; a prefill server failed, or the decode server
    reported the KV never arrived intact): ``retry`` once more on another
    prefill server, or on the decode server itself when there is none;
    ``local`` once more on the decode server; ``fail`` with a clear error.
    ``lease_expiry`` / ``checksum_failure`` (decode server): ``fail`` the
    request (the router may then recover it as above) or prefill it ``local``ly
    at once. Either way the reserved blocks are freed first.
    """

    prefill_failure: PrefillFailure = RouterSettings.prefill_failure
    """Router, when a prefill failed: once more on another prefill server (`retry`), on the decode server
    (`local`), or a clear error (`fail`)."""
    migration_limit: int = Field(default=RouterSettings.migration_limit, ge=0, le=16)
    """Router, when a decode stream broke (server died, stream cut or stalled, engine down, draining): how many
    times one request moves to another decode server, which continues it from the tokens already streamed;
    past it the client gets the error. 0: never."""
    lease_expiry: KvFailureAction = ServerSettings.lease_expiry
    """Decode server, when a lease expired before the KV arrived: fail the request, or prefill it itself."""
    checksum_failure: KvFailureAction = ServerSettings.checksum_failure
    """Decode server, when the KV failed its checksum: fail the request, or prefill it itself."""


class RestartConfig(Strict):
    """What ``pdserve launch`` does when a process fails (deploy/supervisor.py)."""

    policy: Literal["on-failure", "never"] = "on-failure"
    """on-failure: a failed process is started again; never: one failure stops the cluster."""
    backoff_s: float = Field(default=1.0, ge=0)
    """Seconds before the first restart; doubles with each failure in the window."""
    backoff_max_s: float = Field(default=30.0, ge=0)
    """The longest wait before a restart, in seconds."""
    max_restarts: int = Field(default=5, ge=0)
    """Failures of one process within `window_s` before the launcher gives up and stops them all."""
    window_s: float = Field(default=300.0, gt=0)
    """Seconds in which a process's failures count toward `max_restarts`."""


class TracingConfig(Strict):
    """OpenTelemetry traces (off unless ``endpoint`` is set): one trace per request across the
    router, decode and prefill servers, sent over OTLP/HTTP (server_common/tracing.py)."""

    endpoint: str | None = Field(default=TracingSettings.endpoint, pattern=r"^https?://")
    """The OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces; null: tracing off."""
    sample_ratio: float = Field(default=TracingSettings.sample_ratio, ge=0.0, le=1.0)
    """The share of new traces recorded (a client's sampled `traceparent` is honoured)."""

    def settings(self) -> TracingSettings:
        return TracingSettings(endpoint=self.endpoint, sample_ratio=self.sample_ratio)


class TransferConfig(Strict):
    """How prefill servers write KV into the decode servers' blocks (transfer/)."""

    backend: TransferBackendName = ServerSettings.transfer_backend
    """zmq (ZeroMQ over TCP) or nixl (NIXL over UCX)."""
    timeout_s: float = Field(default=ServerSettings.transfer_timeout_s, gt=0)
    """Seconds a KV handshake (a prefill server connecting to a decode server's transfer backend) may take."""
    pull_prefix: bool = ServerSettings.pull_prefix
    """A prefill server reads the part of a prompt's prefix that the decode server's reservation holds and
    its own cache lacks from that decode server instead of computing it (decode-to-prefill reuse,
    docs/kv-tiers.md); a failed read is computed."""
    pull_prefix_margin: float = Field(default=ServerSettings.pull_prefix_margin, ge=0)
    """With `pull_prefix`: a prefix is read only when computing its tokens is estimated to take at least this
    many times as long as reading them (from the prefill server's own observed prefill throughput and past
    reads, prefill_server/pull_rule.py); skipped reads count as `not_worth_it`. 0: always read."""


class PlannerConfig(Strict):
    """The planner in the loop (deploy/planner.py), off by default: every ``interval_s`` it reads what the
    routers served (prompt and output tokens a second, the share of requests within ``ttft_s`` and
    ``tpot_s``) and decides how many prefill and decode servers that load asks for, from the engine's step
    cost (``profile``) corrected by the SLOs it sees met or missed. ``recommend`` logs and exports each
    decision; ``act`` also carries it out: in a launched cluster (``orchestrator: pool``) by switching one
    instance's role at a time through the router; on Kubernetes (``orchestrator: kubernetes``) by running
    the first N of a role's named instances (each a StatefulSet, replicas 1 or 0). It runs as its own
    process (`pdserve planner`), which `pdserve launch` starts after the routers; its decisions are at
    ``/decisions`` and its metrics at ``/metrics`` on ``port``."""

    mode: Literal["off", "recommend", "act"] = "off"
    """off: no planner; recommend: decide and report only; act: decide and carry it out."""
    orchestrator: Literal["pool", "kubernetes"] = "pool"
    """pool: the instances this file lists, roles switched in place; kubernetes: instances run or stopped."""
    interval_s: float = Field(default=10.0, gt=0)
    """Seconds between two decisions."""
    window_s: float = Field(default=20.0, gt=0)
    """Seconds of the routers' figures each decision reads (at least `interval_s`)."""
    ttft_s: float = Field(default=2.0, gt=0)
    """The time-to-first-token target, in seconds."""
    tpot_s: float = Field(default=0.1, gt=0)
    """The time-per-output-token target, in seconds."""
    attainment: float = Field(default=0.9, gt=0, le=1)
    """The share of requests that must meet each target."""
    min_prefill: int = Field(default=1, ge=1)
    """Prefill servers the planner never goes below."""
    min_decode: int = Field(default=1, ge=1)
    """Decode servers the planner never goes below."""
    max_prefill: int = Field(default=8, ge=1)
    """Prefill servers the planner never goes above (kubernetes; at most the prefill instances listed)."""
    max_decode: int = Field(default=8, ge=1)
    """Decode servers the planner never goes above (kubernetes; at most the decode instances listed)."""
    max_instances: int | None = Field(default=None, ge=2)
    """pool: the most instances `pdserve launch` may run, the listed ones included: with `act` it starts one more
    (in the role the load is short of) when the listed ones are not enough, and drains and stops such an added
    one when the load falls (never a listed one); null: the listed instances, roles switched only."""
    target_utilisation: float = Field(default=0.8, gt=0, le=1)
    """kubernetes: each role gets its demand (in servers' worth) over this, rounded up; pool: while the busier
    role's utilisation is below it, no switch."""
    hysteresis: float = Field(default=0.15, ge=0, lt=1)
    """pool: a switch must lower the busier role's utilisation by at least this share."""
    max_moves: int = Field(default=1, ge=1)
    """pool: instances one decision may switch toward the split the load asks for, one after another (a large
    pool's best split can be many instances away)."""
    confirm: int = Field(default=2, ge=1)
    """Decisions in a row that must want the same change before it is made."""
    cooldown_s: float = Field(default=30.0, ge=0)
    """Seconds after a change before the next (kubernetes: before a shrink)."""
    profile: str | None = None
    """The step costs to plan with: a `pdserve plan --save-profile` file; null: `engine.mock_profile` when set,
    else engine/step_cost.py's round figures (the SLO correction then does more of the work)."""
    port: int = Field(default=8090, ge=1, le=65535)
    """The planner's HTTP port: /health, /metrics, /decisions."""
    namespace: str = "default"
    """kubernetes: the namespace the instances' StatefulSets run in (`pdserve render k8s` names them)."""
    routers: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+:\d{1,5}$")
    """HOST:PORT resolved every interval, each address one router to read (on Kubernetes the routers' headless
    Service, which `pdserve render k8s` sets); null: the router, or its replicas, as this file places them."""


class ClusterConfig(Strict):
    """The whole file: the model, the sections, and the instances (prefill and decode, or colocated)."""

    model: str
    """A local Hugging Face folder (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 3 or DeepSeek-V3
    family), or a built-in model built on first use: tiny, tiny-moe, tiny-swa, tiny-mla, smollm2,
    gemma3-270m or qwen2.5-coder-0.5b."""
    served_model_name: str | None = None
    """The model's name in the API; null: the built-in model's name, or the folder's name."""
    model_cache: str = MODEL_CACHE
    """The folder built-in models are built into."""
    dtype: Dtype = EngineConfig.dtype
    """The dtype of the weights and the KV cache."""
    device: str = EngineConfig.device
    """The torch device of every server, unless `engine.device` or an instance's `device` names another."""
    host: str = LOOPBACK_HOST
    """The address of every process, unless its own `host` names another."""
    max_model_len: ModelLen | None = EngineConfig.max_model_len
    """The context length in tokens; null: the model's `max_position_embeddings` (also its upper bound)."""
    lease_s: float = Field(default=ServerSettings.lease_s, gt=0)
    """Seconds a decode server holds blocks reserved for KV that has not arrived."""
    drain_timeout_s: float = Field(default=DRAIN_TIMEOUT_S, gt=0)
    """On SIGTERM, the longest a process waits for its requests in flight, in seconds."""
    drain: DrainMode = RouterSettings.drain
    """A decode server that drains (SIGTERM, and so a Kubernetes pod after its preStop; its `POST /admin/drain`;
    the router's `DELETE /admin/workers/NAME` or `.../drain`): `migrate` moves its running streams to other
    decode servers at once, which continue them from the tokens already streamed (so it leaves in seconds);
    `wait` lets them finish there, up to `drain_timeout_s`. A prefill server always finishes the prefills and
    transfers it started."""
    log_stats_interval_s: float = Field(default=ServerSettings.log_stats_interval_s, ge=0)
    """Seconds between the stats lines each process logs while it has traffic (launch shows them); 0: none."""
    timeline_entries: int = Field(default=ServerSettings.timeline_entries, ge=1)
    """The latest requests each prefill and decode server keeps the stage times of, on `GET /debug/timeline`
    (`pdserve bench serve --timeline` joins them); the oldest go first. A few hundred bytes each."""
    security: SecurityConfig = SecurityConfig()
    """The internal secret, and the prefill and decode servers' connection limits."""
    engine: EngineDefaults = EngineDefaults()
    """Engine settings every instance inherits unless it overrides them."""
    router: RouterConfig = RouterConfig()
    """The router: address, policy, overload and request limits, API keys."""
    transfer: TransferConfig = TransferConfig()
    """How KV moves from prefill to decode servers."""
    recovery: RecoveryConfig = RecoveryConfig()
    """What happens when a step of a request fails (prefill before its first token; decode: migration)."""
    restart: RestartConfig = RestartConfig()
    """What `pdserve launch` does when a process fails (deploy/supervisor.py)."""
    tracing: TracingConfig = TracingConfig()
    """OpenTelemetry traces, off unless `tracing.endpoint` is set."""
    discovery: DiscoveryConfig = DiscoveryConfig()
    """How the router finds its workers."""
    kubernetes: KubernetesConfig = KubernetesConfig()
    """What `pdserve render k8s` needs beyond the cluster; read by nothing else."""
    planner: PlannerConfig = PlannerConfig()
    """The planner in the loop: how many prefill and decode servers the load asks for (off by default)."""
    fault_injection: bool = ServerSettings.fault_injection
    """Test hook: servers mount /admin/faults to inject faults deterministically; keep it false in service."""
    prefill: list[Instance] = Field(default_factory=list)
    """The prefill servers (with `decode`, instead of `colocated`)."""
    decode: list[Instance] = Field(default_factory=list)
    """The decode servers: they own the KV cache and stream the tokens."""
    colocated: list[Instance] = Field(default_factory=list)
    """Servers that prefill and decode in one engine, instead of `prefill` and `decode` (the baseline)."""

    @model_validator(mode="after")
    def _check_layout(self) -> ClusterConfig:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("list either colocated instances or prefill and decode instances, not both")
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError("a cluster needs at least one prefill and one decode instance (or colocated ones)")
        names = [i.name for i in self.instances()]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"instance names must be unique, repeated: {dup}")
        ports = [self.router.port, *self.router_replica_ports]
        ports += [self.planner.port] if self.planner.mode != "off" else []
        ports += [p for i in self.instances() for p in (i.port, i.transfer_port)]
        dup_ports = sorted({p for p in ports if ports.count(p) > 1})
        if dup_ports:
            raise ValueError(
                "ports must be unique (router, its replicas' = router.port + 1.. by default, instance port and "
                f"kv_port = port + 1 by default), repeated: {dup_ports}"
            )
        if any(p > 65535 for p in self.router_replica_ports):
            raise ValueError(
                f"router.port + router.replicas passes 65535 ({self.router.port} + {self.router.replicas}): "
                "set router.replica_ports"
            )
        if self.kubernetes.router_replicas not in (None, self.router.replicas):
            raise ValueError(
                f"kubernetes.router_replicas ({self.kubernetes.router_replicas}) differs from router.replicas "
                f"({self.router.replicas}): the routers' shares of each worker follow router.replicas; set that alone"
            )
        kinds = {i.name: i.kind or self.engine.kind for i in self.instances()}
        if len(set(kinds.values())) > 1:
            mock = sorted(n for n, k in kinds.items() if k == "mock")
            raise ValueError(
                f"instances {mock} are mock engines and the others are not: mock and model servers cannot "
                "exchange KV or continue each other's requests; make them all one kind"
            )
        profiled = [i.name for i in self.instances() if (i.mock_profile or self.engine.mock_profile)]
        if profiled and "mock" not in kinds.values():
            raise ValueError(f"mock_profile is set for {profiled}, which are not mock engines (engine.kind: mock)")
        for i in self.instances():
            tp = self.tensor_parallel_size_of(i)
            ep = i.expert_parallel_size or self.engine.expert_parallel_size
            if ep not in (1, tp):
                raise ValueError(
                    f"{i.name}: expert_parallel_size must be 1 or its tensor_parallel_size ({tp}), got {ep}"
                )
            if tp > 1 and (i.kv_tiers or self.engine.kv_tiers).on:
                raise ValueError(f"{i.name}: kv_tiers hold one rank's blocks: they need tensor_parallel_size 1")
            tiers = (i.kv_tiers or self.engine.kv_tiers).on
            if self.engine.window_kv_blocks is not None and (
                not self.colocated or tp > 1 or tiers or self.engine.cuda_graphs or kinds[i.name] == "mock"
            ):
                raise ValueError(
                    f"{i.name}: engine.window_kv_blocks needs a colocated cluster, tensor_parallel_size 1, no "
                    "kv_tiers, no cuda_graphs and kind model (a transfer, a rank, a tier and a graph address one "
                    "block table)"
                )
        self._check_planner()
        exposed = [
            f"{i.name} ({self.bind_host_of(i)})" for i in self.instances() if not is_loopback(self.bind_host_of(i))
        ]
        if exposed and not self.security.configured:
            raise ValueError(
                f"internal servers bind to interfaces other machines can reach: {', '.join(exposed)}; "
                "set security.internal_secret (or internal_secret_file) so they refuse strangers"
            )
        return self

    # ---- derived ------------------------------------------------------------
    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disaggregated"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if is_builtin(self.model) else Path(self.model).name

    def _check_planner(self) -> None:
        p = self.planner
        if p.mode == "off":
            return
        if self.colocated:
            raise ValueError(
                "planner: a colocated cluster has no prefill:decode ratio to plan; list prefill and decode"
            )
        if p.orchestrator == "pool" and p.min_prefill + p.min_decode > len(self.prefill) + len(self.decode):
            raise ValueError(
                f"planner: min_prefill + min_decode ({p.min_prefill} + {p.min_decode}) is more than the "
                f"{len(self.prefill) + len(self.decode)} instances listed"
            )
        listed = len(self.prefill) + len(self.decode)
        if p.max_instances is not None and p.orchestrator != "pool":
            raise ValueError("planner.max_instances: only with orchestrator pool (kubernetes runs the listed ones)")
        if p.max_instances is not None and p.max_instances < listed:
            raise ValueError(
                f"planner.max_instances ({p.max_instances}) is fewer than the {listed} prefill and decode instances "
                "listed: it counts them too"
            )
        if p.orchestrator == "kubernetes" and (p.min_prefill > len(self.prefill) or p.min_decode > len(self.decode)):
            raise ValueError("planner: min_prefill and min_decode are at most the instances listed for the role")

    def instances(self) -> list[Instance]:
        return [*self.prefill, *self.decode, *self.colocated]

    def role_of(self, name: str) -> EngineMode:
        roles: dict[EngineMode, list[Instance]] = {
            "prefill": self.prefill,
            "decode": self.decode,
            "colocated": self.colocated,
        }
        for role, instances in roles.items():
            if any(i.name == name for i in instances):
                return role
        raise ConfigError(f"no instance named {name!r} (have {[i.name for i in self.instances()]})")

    def instance(self, name: str) -> Instance:
        self.role_of(name)
        return next(i for i in self.instances() if i.name == name)

    def tensor_parallel_size_of(self, instance: Instance) -> int:
        return instance.tensor_parallel_size or self.engine.tensor_parallel_size

    def tensor_parallel_problems(self, model_path: Path) -> list[str]:
        """One line per instance whose tensor_parallel_size the model's heads or MLP do not divide
        (read from its config.json, as the engine would split it: engine/tensor_parallel.py)."""
        sizes = {self.tensor_parallel_size_of(i) for i in self.instances()} - {1}
        if not sizes:
            return []
        cfg = json.loads((model_path / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        problems = {
            size: split_problem(heads, cfg.get("num_key_value_heads") or heads, cfg["intermediate_size"], size)
            for size in sizes
        }
        return [
            f"{i.name}: {problems[self.tensor_parallel_size_of(i)]} ({model_path})"
            for i in self.instances()
            if problems.get(self.tensor_parallel_size_of(i))
        ]

    def host_of(self, instance: Instance) -> str:
        return instance.host or self.host

    def bind_host_of(self, instance: Instance) -> str:
        return instance.bind_host or self.host_of(instance)

    def url_of(self, instance: Instance) -> str:
        return f"http://{self.host_of(instance)}:{instance.port}"

    @property
    def router_host(self) -> str:
        return self.router.host or self.host

    @property
    def router_bind_host(self) -> str:
        return self.router.bind_host or self.router_host

    @property
    def router_url(self) -> str:
        return f"http://{self.router_host}:{self.router.port}"

    @property
    def router_replica_ports(self) -> list[int]:
        """The replicas' HTTP ports under `pdserve launch`; none for a single router (it serves on `router.port`)."""
        r = self.router
        if r.replicas == 1:
            return []
        return list(r.replica_ports) if r.replica_ports is not None else [r.port + 1 + k for k in range(r.replicas)]

    def router_replica_url(self, replica: int) -> str:
        return f"http://{self.router_host}:{self.router_replica_ports[replica]}"

    def max_inflight_of(self, instance: Instance) -> int:
        if instance.max_inflight is not None:
            return instance.max_inflight
        if self.router.max_inflight_per_worker is not None:
            return self.router.max_inflight_per_worker
        return instance.max_num_seqs or self.engine.max_num_seqs

    def model_path(self) -> Path:
        """The model folder, built first if it is a built-in model not built yet."""
        return resolve_model(self.model, self.model_cache)

    def router_settings(
        self, model_path: Path, response_store_file: str | None = None, replica: int | None = None
    ) -> RouterSettings:
        """With ``discovery.kind: dns`` the router starts with no worker: they join as DNS finds them.
        ``response_store_file``: where stored responses go unless ``router.response_store.path`` says
        (`pdserve launch` gives its run folder's). ``replica``: which of ``router.replicas`` this router
        is under `pdserve launch` (its port, and its exact part of each worker's limit); None: a router
        that knows only how many there are (a pod of the Kubernetes Deployment), on ``router.port``."""
        r = self.router
        if replica is not None and not 0 <= replica < r.replicas:
            raise ConfigError(f"router replica {replica} does not exist: router.replicas is {r.replicas}")

        def share(limit: int) -> int:
            return replica_share(limit, r.replicas, replica)

        workers = (
            ()
            if self.discovery.kind == "dns"
            else tuple(
                WorkerSpec(
                    i.name, "prefill" if i in self.prefill else "decode", self.url_of(i), share(self.max_inflight_of(i))
                )
                for i in self.instances()
            )
        )
        discovery = DiscoverySettings(
            kind=self.discovery.kind,
            names=tuple(self.discovery.names),
            interval_s=self.discovery.interval_s,
            max_inflight=share(r.max_inflight_per_worker or self.engine.max_num_seqs),
        )
        return RouterSettings(
            model_path=str(model_path),
            served_model_name=self.model_name,
            workers=workers,
            host=self.router_host,
            port=r.port if replica is None or r.replicas == 1 else self.router_replica_ports[replica],
            limit_share=1.0 / r.replicas,
            max_model_len=self.max_model_len,
            drain_timeout_s=self.drain_timeout_s,
            drain=self.drain,
            log_stats_interval_s=self.log_stats_interval_s,
            prefill_failure=self.recovery.prefill_failure,
            migration_limit=self.recovery.migration_limit,
            api_keys=r.api_key_values(),
            tenants=r.tenant_settings(),
            priority_classes=tuple(r.priority_classes),
            internal_secret=self.security.secret(),
            tracing=self.tracing.settings(),
            discovery=discovery,
            grammar_limits=r.grammar_limits.limits(),
            grammar_sandbox=r.grammar_limits.sandbox(),
            response_store=r.response_store.settings(response_store_file),
            **{name: getattr(r, name) for name in ROUTER_KEYS_AS_IS},
        )

    def engine_knob(self, name: str, key: str) -> Any:
        """Instance ``name``'s value of engine key ``key``: its own, else the ``engine:`` section's."""
        own = getattr(self.instance(name), key)
        return getattr(self.engine, key) if own is None else own

    def kv_memory(self, name: str, model_path: Path) -> ServerMemory:
        """What instance ``name`` asks of its host's memory (deploy/kv_memory.py)."""
        return server_memory(
            name,
            model_path,
            EngineConfig(model=str(model_path), dtype=self.dtype).torch_dtype,
            self.engine_knob(name, "tensor_parallel_size"),
            self.engine_knob(name, "expert_parallel_size") > 1,
            self.max_model_len,
            self.engine_knob(name, "max_num_seqs"),
            self.engine_knob(name, "device") or self.device,
            weights_loaded=self.engine_knob(name, "kind") == "model",
        )

    def auto_kv_cache_bytes(self, names: Collection[str], model_path: Path, memory: HostMemory) -> dict[str, int]:
        """``kv_cache_bytes`` of each of ``names`` whose setting is ``auto``, when ``names`` are the servers one
        host starts together (raises KvMemoryError where the host has too little)."""
        auto = [n for n in names if self.engine_knob(n, "kv_cache_bytes") == AUTO]
        if not auto:
            return {}
        servers = [self.kv_memory(n, model_path) for n in names]
        sizes = auto_kv_cache_bytes(memory, servers, self.engine.kv_cache_memory_fraction)
        return {n: sizes[n] for n in auto}

    def server_settings(self, name: str, model_path: Path, kv_cache_bytes: int | None = None) -> ServerSettings:
        """Server ``name``'s settings; ``kv_cache_bytes``: its KV cache as its launcher sized it, else the
        config's (``auto``: sized here, as the only server on its host)."""
        role = self.role_of(name)
        inst = self.instance(name)
        knobs = {
            **self.engine.model_dump(exclude={"kv_cache_memory_fraction"}),
            **{key: getattr(inst, key) for key in INSTANCE_ENGINE_KEYS if getattr(inst, key) is not None},
        }
        if kv_cache_bytes is not None:
            knobs["kv_cache_bytes"] = kv_cache_bytes
        elif knobs["kv_cache_bytes"] == AUTO:
            knobs["kv_cache_bytes"] = self.auto_kv_cache_bytes([name], model_path, HostMemory.read())[name]
        knobs["device"] = knobs["device"] or self.device
        tenants = (DEFAULT_TENANT, *(t.name for t in self.router.tenants if t.name != DEFAULT_TENANT))
        knobs["kv_tiers"] = (inst.kv_tiers or self.engine.kv_tiers).for_server(name, tenants)
        engine = EngineConfig(
            model=str(model_path), dtype=self.dtype, max_model_len=self.max_model_len, mode=role, **knobs
        )
        return ServerSettings(
            name=name,
            role=role,
            engine=engine,
            host=self.host_of(inst),
            bind_host=inst.bind_host,
            port=inst.port,
            kv_port=inst.transfer_port,
            transfer_backend=self.transfer.backend,
            lease_s=self.lease_s,
            transfer_timeout_s=self.transfer.timeout_s,
            pull_prefix=self.transfer.pull_prefix,
            pull_prefix_margin=self.transfer.pull_prefix_margin,
            lease_expiry=self.recovery.lease_expiry,
            checksum_failure=self.recovery.checksum_failure,
            fault_injection=self.fault_injection,
            drain_timeout_s=self.drain_timeout_s,
            drain=self.drain,
            log_stats_interval_s=self.log_stats_interval_s,
            timeline_entries=self.timeline_entries,
            internal_secret=self.security.secret(),
            tracing=self.tracing.settings(),
            decode_peers=tuple((i.name, self.url_of(i)) for i in self.decode),
            max_unfilled_blocks_per_caller=self.security.max_unfilled_blocks_per_caller,
            header_timeout_s=self.security.server_header_timeout_s,
            body_timeout_s=self.security.server_body_timeout_s,
            max_connections_per_client=self.security.server_max_connections_per_client,
            max_connections=self.security.server_max_connections,
            reserved_connections=self.security.server_reserved_connections,
            trusted_clients=tuple(sorted({self.router_host} | {self.host_of(i) for i in self.instances()})),
        )


def replica_share(limit: int, replicas: int, replica: int | None) -> int:
    """One router's part of a worker's in-flight ``limit`` shared by ``replicas`` routers: ``limit // replicas``,
    the remainder one each to the first replicas, and at least 1 (a worker's own "no room" answer then
    bounds what the routers together send it). ``replica`` None (a Kubernetes pod, which has no index):
    the floor part alone, so that routers that cannot tell which they are still never exceed ``limit``."""
    part = limit // replicas
    if replica is not None and replica < limit % replicas:
        part += 1
    return max(part, 1)


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _lookup(data: Any, loc: tuple) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def parse_config(data: object, source: str) -> ClusterConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            key = _where(loc)
            secret = looks_secret(loc)
            if err["type"] == "extra_forbidden":
                value = "(hidden)" if secret else repr(err["input"])
                lines.append(f"{source}: unknown key {key!r} (value {value})")
            elif err["type"] == "missing":
                lines.append(f"{source}: missing key {key!r}")
            elif not loc:
                lines.append(f"{source}: {err['msg'].removeprefix('Value error, ')}")
            elif isinstance(_lookup(data, loc), dict):
                # A section's own check (its message names the keys): the section is not echoed, since
                # it may hold a secret (router.api_keys, router.response_store.url).
                lines.append(f"{source}: bad {key!r}: {err['msg'].removeprefix('Value error, ')}")
            else:
                value = "(hidden)" if secret else repr(_lookup(data, loc))
                lines.append(f"{source}: bad value {value} for {key!r}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))
